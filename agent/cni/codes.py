"""The CNI error codes and versions the agent answers with: plain constants, importable by the
pure request parser without the socket code around them (agent.cni.protocol).

The shim (agent/cni/plugin.py) is self-contained, so it keeps its own copy of the codes it
shares with the agent; tests/test_cni_codes.py holds the two equal."""

from __future__ import annotations

SUPPORTED_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]

# CNI spec error codes
ERR_INCOMPATIBLE_VERSION = 1
ERR_UNSUPPORTED_FIELD = 2
ERR_UNKNOWN_CONTAINER = 3
ERR_INVALID_ENV = 4
ERR_IO = 5
ERR_DECODE = 6
ERR_INVALID_NETCONF = 7
ERR_TRY_AGAIN = 11
# plugin-specific (>= 50 for the shim's own, >= 100 the agent's)
ERR_PLUGIN_NOT_AVAILABLE = 50
ERR_AGENT_UNREACHABLE = 100
ERR_CAPTURE_FAILED = 101
ERR_CHECK_DRIFT = 102
ERR_BAD_REQUEST = 103
