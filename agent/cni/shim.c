/*
 * aether-cni, native build: the same thin shim as plugin.py, with no interpreter to start.
 *
 * kubelet execs the chained plugin on every pod start; this forwards CNI_* and the raw
 * netconf to the node agent over its unix socket as {"v":2,"env":{...},"stdin":<netconf>}
 * and relays the answer "<exit code>\n<stdout>". CNI semantics live in the agent
 * (agent/cni/request.py). Fail closed: no agent, no capture, ADD fails.
 * Build: cc -O2 -static -o aether-cni shim.c   (falls back to dynamic linking)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_MSG (1 << 20)
#define DEFAULT_SOCKET "/var/run/aether/cni.sock"
#define VERSION_JSON "{\"cniVersion\": \"1.0.0\", \"supportedVersions\": " \
                     "[\"0.3.0\", \"0.3.1\", \"0.4.0\", \"1.0.0\", \"1.1.0\"]}"

static const char *ENV_KEYS[] = {"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME",
                                 "CNI_ARGS", "CNI_PATH", NULL};

typedef struct { char *p; size_t len, cap; } buf_t;

static void put(buf_t *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { perror("aether-cni: out of memory"); exit(1); }
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
static void puts_(buf_t *b, const char *s) { put(b, s, strlen(s)); }

static void put_json_str(buf_t *b, const char *s) {
    char tmp[8];
    puts_(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') { tmp[0] = '\\'; tmp[1] = (char)*c; put(b, tmp, 2); }
        else if (*c < 0x20 || *c == 0x7f) { snprintf(tmp, sizeof tmp, "\\u%04x", *c); puts_(b, tmp); }
        else put(b, (const char *)c, 1);  /* UTF-8 bytes pass through */
    }
    puts_(b, "\"");
}

/* A top-level "key": "value" or "key": number, found by scanning (no JSON parser needed). */
static int find_value(const char *json, const char *key, char *out, size_t outlen) {
    char needle[64];
    snprintf(needle, sizeof needle, "\"%s\"", key);
    const char *p = strstr(json, needle);
    if (!p) return 0;
    p += strlen(needle);
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p != ':') return 0;
    p++;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    size_t n = 0;
    if (*p == '"') {
        p++;
        while (*p && *p != '"' && *p != '\\' && n + 1 < outlen) out[n++] = *p++;
        if (*p != '"') return 0;
    } else {
        while (*p && (*p == '.' || (*p >= '0' && *p <= '9')) && n + 1 < outlen) out[n++] = *p++;
    }
    out[n] = 0;
    return n > 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* 0 ok; -1 with errno set on failure (ETIMEDOUT for our own deadline). */
static int exchange(const char *path, const buf_t *req, double timeout, buf_t *ans) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) { errno = ENAMETOOLONG; return -1; }
    strcpy(sa.sun_path, path);
    double deadline = now() + timeout;
    int fd;
    for (;;) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) break;
        int e = errno;
        close(fd);
        if (e == EAGAIN && now() < deadline) { usleep(10000); continue; }  /* full backlog */
        errno = e;
        return -1;
    }
    size_t off = 0;
    while (off < req->len) {
        ssize_t n = send(fd, req->p + off, req->len - off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            /* the agent answered before reading it all (busy, too large): read that answer */
            if (errno == EPIPE || errno == ECONNRESET) break;
            int e = errno; close(fd); errno = e; return -1;
        }
        off += (size_t)n;
    }
    if (off == req->len) shutdown(fd, SHUT_WR);
    char chunk[65536];
    for (;;) {
        int left = (int)((deadline - now()) * 1000);
        if (left <= 0) { close(fd); errno = ETIMEDOUT; return -1; }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, left);
        if (r < 0) { if (errno == EINTR) continue; int e = errno; close(fd); errno = e; return -1; }
        if (r == 0) { close(fd); errno = ETIMEDOUT; return -1; }
        ssize_t n = recv(fd, chunk, sizeof chunk, 0);
        if (n < 0 && errno == ECONNRESET && ans->len > 0) break;  /* answered, then closed */
        if (n < 0) { if (errno == EINTR) continue; int e = errno; close(fd); errno = e; return -1; }
        if (n == 0) break;
        if (ans->len + (size_t)n > MAX_MSG) { close(fd); errno = EMSGSIZE; return -1; }
        put(ans, chunk, (size_t)n);
    }
    close(fd);
    return 0;
}

int main(void) {
    const char *command = getenv("CNI_COMMAND");
    if (!command) command = "";
    if (strcmp(command, "VERSION") == 0) { fputs(VERSION_JSON, stdout); return 0; }

    buf_t in = {0};
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0) {
        if (in.len + n > MAX_MSG) break;
        put(&in, chunk, n);
    }
    if (!in.p) puts_(&in, "");

    char sock[sizeof(((struct sockaddr_un *)0)->sun_path)] = DEFAULT_SOCKET;
    char value[128];
    find_value(in.p, "agent_socket", sock, sizeof sock);
    double timeout = 30.0;
    if (find_value(in.p, "agent_timeout_seconds", value, sizeof value)) {
        double t = strtod(value, NULL);
        if (t > 0) timeout = t;
    }
    char version[32] = "1.0.0";
    find_value(in.p, "cniVersion", version, sizeof version);

    buf_t req = {0};
    puts_(&req, "{\"v\":2,\"env\":{");
    for (int i = 0; ENV_KEYS[i]; i++) {
        const char *v = getenv(ENV_KEYS[i]);
        if (i) puts_(&req, ",");
        put_json_str(&req, ENV_KEYS[i]);
        puts_(&req, ":");
        put_json_str(&req, v ? v : "");
    }
    puts_(&req, "},\"stdin\":");
    /* the raw netconf: the agent parses it (and answers a decode error if it is not JSON) */
    const char *s = in.p;
    while (*s == ' ' || *s == '\n' || *s == '\r' || *s == '\t') s++;
    puts_(&req, *s ? in.p : "null");
    puts_(&req, "}");

    buf_t ans = {0};
    if (exchange(sock, &req, timeout, &ans) == 0) {
        char *nl = ans.p ? strchr(ans.p, '\n') : NULL;
        if (nl) {
            *nl = 0;
            char *end;
            long rc = strtol(ans.p, &end, 10);
            if (end != ans.p && *end == 0) {
                fputs(nl + 1, stdout);
                return (int)rc;
            }
        }
        errno = EPROTO;
    }
    int e = errno;
    int absent = (e == ENOENT || e == ECONNREFUSED);
    if ((strcmp(command, "DEL") == 0 || strcmp(command, "GC") == 0) && absent) {
        fprintf(stderr, "aether-cni: no agent at %s on DEL (%s); the agent cleans up on "
                "restart\n", sock, strerror(e));
        return 0;
    }
    buf_t out = {0};
    char msg[512];
    int code = 100;
    if (strcmp(command, "DEL") == 0) {
        snprintf(msg, sizeof msg, "aether agent at %s did not finish DEL: try again", sock);
        code = 11;
    } else if (strcmp(command, "STATUS") == 0) {
        snprintf(msg, sizeof msg, "aether agent is not reachable at %s: the plugin is not "
                 "available", sock);
        code = 50;
    } else if (e == ETIMEDOUT) {
        snprintf(msg, sizeof msg, "aether agent is not reachable at %s (no answer within %gs): "
                 "the pod cannot be captured", sock, timeout);
    } else {
        snprintf(msg, sizeof msg, "aether agent is not reachable at %s: the pod cannot be "
                 "captured", sock);
    }
    puts_(&out, "{\"cniVersion\": ");
    put_json_str(&out, version);
    snprintf(value, sizeof value, ", \"code\": %d, \"msg\": ", code);
    puts_(&out, value);
    put_json_str(&out, msg);
    puts_(&out, ", \"details\": ");
    put_json_str(&out, strerror(e));
    puts_(&out, "}");
    fputs(out.p, stdout);
    return 1;
}
