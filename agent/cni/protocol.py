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

# What the shim and the agent must agree on is defined in the self-contained shim (its
# socket path and limits) and in agent.cni.codes (the codes, which the shim mirrors).
from agent.cni.codes import ERR_AGENT_UNREACHABLE as ERR_AGENT_UNREACHABLE
from agent.cni.codes import ERR_BAD_REQUEST as ERR_BAD_REQUEST
from agent.cni.codes import ERR_CAPTURE_FAILED as ERR_CAPTURE_FAILED
from agent.cni.codes import ERR_CHECK_DRIFT as ERR_CHECK_DRIFT
from agent.cni.codes import ERR_DECODE as ERR_DECODE
from agent.cni.codes import ERR_INCOMPATIBLE_VERSION as ERR_INCOMPATIBLE_VERSION
from agent.cni.codes import ERR_INVALID_ENV as ERR_INVALID_ENV
from agent.cni.codes import ERR_INVALID_NETCONF as ERR_INVALID_NETCONF
from agent.cni.codes import ERR_IO as ERR_IO
from agent.cni.codes import ERR_PLUGIN_NOT_AVAILABLE as ERR_PLUGIN_NOT_AVAILABLE
from agent.cni.codes import ERR_TRY_AGAIN as ERR_TRY_AGAIN
from agent.cni.codes import ERR_UNKNOWN_CONTAINER as ERR_UNKNOWN_CONTAINER
from agent.cni.codes import ERR_UNSUPPORTED_FIELD as ERR_UNSUPPORTED_FIELD
from agent.cni.codes import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
from agent.cni.plugin import DEFAULT_SOCKET as DEFAULT_SOCKET
from agent.cni.plugin import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from agent.cni.plugin import MAX_MESSAGE_BYTES as MAX_REQUEST_BYTES


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
