"""The agent's side of the wire formats.

CNI socket (`aether-cni` → agent): the shim sends `{"v":2,"env":{CNI_*…},"stdin":<netconf>}`
and half-closes; the agent answers `<exit code>\\n<stdout for kubelet>`. The shim stays free of
a JSON parser on the happy path, and every CNI rule is applied in one place (request.py).

Status socket: one JSON object each way (`call()`), as `aether-agent status` uses it.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

# What the shim and the agent must agree on is defined once, in the self-contained shim.
from agent.cni.plugin import (  # noqa: F401 - re-exported for the agent side
    DEFAULT_SOCKET,
    DEFAULT_TIMEOUT_S,
    ERR_AGENT_UNREACHABLE,
    ERR_PLUGIN_NOT_AVAILABLE,
    ERR_TRY_AGAIN,
)
from agent.cni.plugin import MAX_MESSAGE_BYTES as MAX_REQUEST_BYTES

SUPPORTED_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]

# CNI spec error codes
ERR_INCOMPATIBLE_VERSION = 1
ERR_UNSUPPORTED_FIELD = 2
ERR_UNKNOWN_CONTAINER = 3
ERR_INVALID_ENV = 4
ERR_IO = 5
ERR_DECODE = 6
ERR_INVALID_NETCONF = 7
# plugin-specific (>= 100)
ERR_CAPTURE_FAILED = 101
ERR_CHECK_DRIFT = 102
ERR_BAD_REQUEST = 103


class ProtocolError(Exception):
    pass


def recv_all(sock: socket.socket, limit: int = MAX_REQUEST_BYTES,
             deadline: float | None = None) -> bytes:
    """Everything until the peer half-closes. ``deadline`` (time.monotonic()) bounds the
    whole message, not each recv: a client trickling a byte at a time still runs out."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request not complete within its deadline")
            sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"message larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def call(socket_path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """JSON request/answer on the status socket. OSError/TimeoutError: agent unreachable."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(json.dumps(request).encode())
        s.shutdown(socket.SHUT_WR)
        raw = recv_all(s)
    if not raw:
        raise ConnectionError("agent closed the connection without an answer")
    answer = json.loads(raw)
    if not isinstance(answer, dict):
        raise ProtocolError("agent answer is not an object")
    return answer
