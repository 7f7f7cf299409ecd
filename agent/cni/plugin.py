"""`aether-cni`: the chained CNI plugin kubelet executes (CNI spec 1.0.0; 0.3.x/0.4.0 too).

A thin shim on purpose: stdlib only, it forwards the request to the node agent over a unix
socket and relays the answer. On ADD it fails closed: no agent, no capture, no pod start.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, TextIO

# This file is self-contained (stdlib only, no package imports): cni-install copies it to the
# host CNI bin dir, where it runs as `python -I -S aether-cni` with nothing else around it.

MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_SOCKET = "/var/run/aether/cni.sock"
DEFAULT_TIMEOUT_S = 30.0
SUPPORTED_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]

# CNI spec error codes, then plugin-specific ones (>= 100)
ERR_INCOMPATIBLE_VERSION = 1
ERR_UNSUPPORTED_FIELD = 2
ERR_UNKNOWN_CONTAINER = 3
ERR_INVALID_ENV = 4
ERR_IO = 5
ERR_DECODE = 6
ERR_INVALID_NETCONF = 7
ERR_TRY_AGAIN = 11
ERR_AGENT_UNREACHABLE = 100
ERR_CAPTURE_FAILED = 101
ERR_CHECK_DRIFT = 102
ERR_BAD_REQUEST = 103


class ProtocolError(Exception):
    pass


def recv_all(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"message larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def call(socket_path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request, wait for the answer. OSError/TimeoutError mean 'agent unreachable'.

    One JSON object each way; the client half-closes after writing. A full accept queue
    (EAGAIN) is retried until the timeout rather than reported as an unreachable agent.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                s.connect(socket_path)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                s.close()
                time.sleep(0.01)
                continue
            s.sendall(json.dumps(request).encode())
            s.shutdown(socket.SHUT_WR)
            raw = recv_all(s)
        finally:
            s.close()
        break
    if not raw:
        raise ConnectionError("agent closed the connection without an answer")
    answer = json.loads(raw)
    if not isinstance(answer, dict):
        raise ProtocolError("agent answer is not an object")
    return answer




def cni_error(code: int, msg: str, details: str = "", version: str = "1.0.0") -> dict[str, Any]:
    return {"cniVersion": version, "code": code, "msg": msg, "details": details}


def parse_cni_args(raw: str) -> dict[str, str]:
    """CNI_ARGS 'IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;…' → dict (malformed pairs skipped)."""
    out: dict[str, str] = {}
    for part in raw.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def prev_result_ips(prev: Any) -> list[str]:
    """Addresses from a prevResult of any supported version (0.3+ all use `ips`)."""
    ips: list[str] = []
    if isinstance(prev, dict):
        for entry in prev.get("ips") or []:
            if isinstance(entry, dict) and isinstance(entry.get("address"), str):
                ips.append(entry["address"].split("/")[0])
    return ips


def build_request(env: dict[str, str], netconf: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": env.get("CNI_COMMAND", ""),
        "container_id": env.get("CNI_CONTAINERID", ""),
        "netns": env.get("CNI_NETNS", ""),
        "ifname": env.get("CNI_IFNAME", ""),
        "args": parse_cni_args(env.get("CNI_ARGS", "")),
        "cni_version": str(netconf.get("cniVersion", "")),
        "netconf": netconf,
        "ips": prev_result_ips(netconf.get("prevResult")),
    }


def run(env: dict[str, str], stdin: str, stdout: TextIO, stderr: TextIO) -> int:
    """The plugin, as a function of its inputs: returns the exit code."""
    command = env.get("CNI_COMMAND", "")
    if command == "VERSION":
        json.dump({"cniVersion": "1.0.0", "supportedVersions": SUPPORTED_VERSIONS}, stdout)
        return 0
    try:
        netconf = json.loads(stdin) if stdin.strip() else {}
        if not isinstance(netconf, dict):
            raise ValueError("netconf is not a JSON object")
    except ValueError as e:
        json.dump(cni_error(ERR_DECODE, "failed to decode network configuration", str(e)), stdout)
        return 1
    version = str(netconf.get("cniVersion", "1.0.0"))
    if version not in SUPPORTED_VERSIONS:
        json.dump(
            cni_error(
                ERR_INCOMPATIBLE_VERSION,
                f"unsupported cniVersion {version!r}",
                f"supported: {', '.join(SUPPORTED_VERSIONS)}",
            ),
            stdout,
        )
        return 1
    if command not in ("ADD", "DEL", "CHECK"):
        json.dump(cni_error(ERR_INVALID_ENV, f"unknown CNI_COMMAND {command!r}", "", version), stdout)
        return 1
    if command in ("ADD", "CHECK") and "prevResult" not in netconf:
        json.dump(
            cni_error(
                ERR_INVALID_NETCONF,
                "aether-cni must be chained after a primary plugin: prevResult is missing",
                "",
                version,
            ),
            stdout,
        )
        return 1
    if command == "ADD" and not env.get("CNI_NETNS"):
        json.dump(cni_error(ERR_INVALID_ENV, "CNI_NETNS is required for ADD", "", version), stdout)
        return 1

    sock = str(netconf.get("agent_socket") or DEFAULT_SOCKET)
    try:
        timeout = float(netconf.get("agent_timeout_seconds") or DEFAULT_TIMEOUT_S)
    except (TypeError, ValueError):
        timeout = DEFAULT_TIMEOUT_S
    request = build_request(env, netconf)
    try:
        answer = call(sock, request, timeout)
    except (OSError, ValueError, ProtocolError) as e:
        if command == "DEL":
            # Nothing we can clean without the agent; it reconciles dead pods when it returns.
            print(f"aether-cni: agent not reachable at {sock} on DEL ({e}); "
                  "the agent cleans up on restart", file=stderr)
            return 0
        json.dump(
            cni_error(
                ERR_AGENT_UNREACHABLE,
                f"aether agent is not reachable at {sock}: the pod cannot be captured",
                f"{type(e).__name__}: {e}",
                version,
            ),
            stdout,
        )
        return 1
    if not answer.get("ok"):
        json.dump(
            cni_error(
                int(answer.get("code") or ERR_CAPTURE_FAILED),
                str(answer.get("msg") or "aether agent refused the request"),
                str(answer.get("details") or ""),
                version,
            ),
            stdout,
        )
        return 1
    if command == "ADD":
        result = dict(netconf["prevResult"])
        result.setdefault("cniVersion", version)
        json.dump(result, stdout)
    return 0


def main() -> None:
    sys.exit(run(dict(os.environ), sys.stdin.read(), sys.stdout, sys.stderr))


if __name__ == "__main__":
    main()
