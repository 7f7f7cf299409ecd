"""`aether-cni`: the chained CNI plugin kubelet executes (CNI spec 1.0.0; 0.3.x/0.4.0 too).

Thin on purpose, because kubelet execs it on every pod start: it forwards the CNI_* variables
and the raw netconf to the node agent over a unix socket and relays the agent's answer (exit
code + stdout). The CNI semantics (version checks, prevResult, error objects) live in the
agent (`agent/cni/request.py`). On the happy path it imports only `os`, `sys` and `_socket`;
`json` is loaded only to build an error when the agent cannot be reached. On ADD it fails
closed: no agent, no capture, no pod start.

This file is self-contained (stdlib only, no package imports): cni-install copies it to the
host CNI bin dir, where it runs as `python -IS aether-cni` with nothing else around it.
"""

from __future__ import annotations

import os
import sys

try:  # the C module: `socket` would pull in enum and selectors (~5 ms of start-up)
    import _socket as socket
except ImportError:  # pragma: no cover - non-CPython
    import socket  # type: ignore[no-redef]

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs start-up time
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, TextIO

DEFAULT_SOCKET = "/var/run/aether/cni.sock"
DEFAULT_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 1 << 20
VERSION_JSON = ('{"cniVersion": "1.0.0", "supportedVersions": '
                '["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}')
ENV_KEYS = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH")
ERR_TRY_AGAIN = 11
ERR_AGENT_UNREACHABLE = 100
ERR_PLUGIN_NOT_AVAILABLE = 50


def _js(s: str) -> str:
    """A JSON string literal without importing json (env values are short ASCII)."""
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif o < 0x20 or o > 0x7E:
            out.append(f"\\u{o:04x}" if o < 0x10000 else ch)
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _netconf_value(stdin: str, key: str, default: Any) -> Any:
    """One top-level netconf value, parsed only when needed (error paths, socket path)."""
    import json
    try:
        conf = json.loads(stdin)
        return conf.get(key, default) if isinstance(conf, dict) else default
    except ValueError:
        return default


def _find_str(stdin: str, key: str) -> str | None:
    """Cheap lookup of a simple string value ("key": "value") without a JSON parser."""
    needle = '"' + key + '"'
    i = stdin.find(needle)
    if i < 0:
        return None
    j = stdin.find(":", i + len(needle))
    k = stdin.find('"', j + 1) if j >= 0 else -1
    if k < 0 or stdin[j + 1:k].strip():
        return None
    end = stdin.find('"', k + 1)
    value = stdin[k + 1:end] if end > k else None
    return None if value is None or "\\" in value else value


def request_bytes(env: Mapping[str, str], stdin: str) -> bytes:
    fields = ",".join(_js(k) + ":" + _js(env.get(k, "")) for k in ENV_KEYS)
    body = stdin.strip() or "null"
    return ('{"v":2,"env":{' + fields + '},"stdin":' + body + "}").encode()


def exchange(path: str, payload: bytes, timeout: float) -> tuple[int, str]:
    """One request, one answer `<exit code>\\n<stdout>`. A full accept queue (EAGAIN) is
    retried until the timeout rather than reported as an unreachable agent."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                s.connect(path)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
                continue
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the agent answered before reading it all (busy, too large): read on
            chunks: list[bytes] = []
            size = 0
            while True:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    if not chunks:
                        raise
                    break  # answered, then closed
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_MESSAGE_BYTES:
                    raise ConnectionError("answer too large")
                chunks.append(chunk)
        finally:
            s.close()
        raw = b"".join(chunks).decode()
        head, sep, out = raw.partition("\n")
        if not sep or not head.strip().lstrip("-").isdigit():
            raise ConnectionError("agent sent no answer")
        return int(head), out


def run(env: Mapping[str, str], stdin: str, stdout: TextIO, stderr: TextIO) -> int:
    """The plugin, as a function of its inputs: returns the exit code."""
    command = env.get("CNI_COMMAND", "")
    if command == "VERSION":
        stdout.write(VERSION_JSON)
        return 0
    sock = _find_str(stdin, "agent_socket") or _netconf_value(stdin, "agent_socket", None) \
        or DEFAULT_SOCKET
    timeout = DEFAULT_TIMEOUT_S
    if '"agent_timeout_seconds"' in stdin:
        try:
            timeout = float(_netconf_value(stdin, "agent_timeout_seconds", DEFAULT_TIMEOUT_S))
        except (TypeError, ValueError):
            pass
    try:
        rc, out = exchange(str(sock), request_bytes(env, stdin), timeout)
    except (OSError, ValueError) as e:
        absent = isinstance(e, (FileNotFoundError, ConnectionRefusedError))
        if command in ("DEL", "GC") and absent:
            # No agent at all: nothing it holds can be cleaned now; it reconciles dead pods
            # when it returns. (A slow or failing agent is different: kubelet retries.)
            stderr.write(f"aether-cni: no agent at {sock} on DEL ({e}); the agent cleans "
                         "up on restart\n")
            return 0
        import json
        version = _netconf_value(stdin, "cniVersion", "1.0.0")
        if command == "DEL":
            msg = f"aether agent at {sock} did not finish DEL: try again"
            code = ERR_TRY_AGAIN
        elif command == "STATUS":
            msg = f"aether agent is not reachable at {sock}: the plugin is not available"
            code = ERR_PLUGIN_NOT_AVAILABLE
        elif isinstance(e, TimeoutError):
            msg = (f"aether agent is not reachable at {sock} (no answer within {timeout:g}s): "
                   "the pod cannot be captured")
            code = ERR_AGENT_UNREACHABLE
        else:
            msg = f"aether agent is not reachable at {sock}: the pod cannot be captured"
            code = ERR_AGENT_UNREACHABLE
        stdout.write(json.dumps({
            "cniVersion": str(version),
            "code": code,
            "msg": msg,
            "details": f"{type(e).__name__}: {e}",
        }))
        return 1
    stdout.write(out)
    return rc


def main() -> None:
    sys.exit(run(os.environ, sys.stdin.read(), sys.stdout, sys.stderr))


if __name__ == "__main__":
    main()
