"""The shim is self-contained (it runs as a standalone file on the host), so the codes it
shares with the agent exist twice; they must not drift."""

from __future__ import annotations

import json

from agent.cni import codes, plugin


def test_the_shim_and_the_agent_agree_on_codes_and_versions() -> None:
    for name in ("ERR_TRY_AGAIN", "ERR_AGENT_UNREACHABLE", "ERR_PLUGIN_NOT_AVAILABLE"):
        assert getattr(plugin, name) == getattr(codes, name), name
    assert json.loads(plugin.VERSION_JSON)["supportedVersions"] == codes.SUPPORTED_VERSIONS
