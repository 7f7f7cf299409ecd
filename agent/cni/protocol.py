"""The wire format between the `aether-cni` shim and the agent.

One request a connection: the shim writes a JSON object and shuts down its write side; the
agent answers one JSON object and closes. Small, debuggable with `socat`, no framing bugs.
The definitions live in the self-contained shim (plugin.py); the agent imports them here.
"""

from __future__ import annotations

from agent.cni.plugin import (
    DEFAULT_SOCKET,
    DEFAULT_TIMEOUT_S,
    ERR_AGENT_UNREACHABLE,
    ERR_BAD_REQUEST,
    ERR_CAPTURE_FAILED,
    ERR_CHECK_DRIFT,
    ERR_DECODE,
    ERR_INCOMPATIBLE_VERSION,
    ERR_INVALID_ENV,
    ERR_INVALID_NETCONF,
    ERR_IO,
    ERR_TRY_AGAIN,
    ERR_UNKNOWN_CONTAINER,
    ERR_UNSUPPORTED_FIELD,
    MAX_MESSAGE_BYTES,
    SUPPORTED_VERSIONS,
    ProtocolError,
    call,
    recv_all,
)

MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES

__all__ = [
    "DEFAULT_SOCKET", "DEFAULT_TIMEOUT_S", "ERR_AGENT_UNREACHABLE", "ERR_BAD_REQUEST",
    "ERR_CAPTURE_FAILED", "ERR_CHECK_DRIFT", "ERR_DECODE", "ERR_INCOMPATIBLE_VERSION",
    "ERR_INVALID_ENV", "ERR_INVALID_NETCONF", "ERR_IO", "ERR_TRY_AGAIN", "ERR_UNKNOWN_CONTAINER",
    "ERR_UNSUPPORTED_FIELD", "MAX_REQUEST_BYTES", "SUPPORTED_VERSIONS", "ProtocolError", "call",
    "recv_all",
]
