"""The shim is self-contained (it runs as a standalone file on the host), so the codes it
shares with the agent exist twice; they must not drift."""

from __future__ import annotations

import json

from agent.cni import codes, plugin


def test_the_shim_and_the_agent_agree_on_codes_and_versions() -> None:
    for name in ("ERR_TRY_AGAIN", "ERR_AGENT_UNREACHABLE", "ERR_PLUGIN_NOT_AVAILABLE"):
        assert getattr(plugin, name) == getattr(codes, name), name
    assert json.loads(plugin.VERSION_JSON)["supportedVersions"] == codes.SUPPORTED_VERSIONS


def test_the_request_parser_builds_the_frozen_request_or_names_the_error() -> None:
    import pytest

    from agent.cni.messages import CniFailure, CniRequest
    from agent.cni.request import to_request

    req = to_request({"command": "DEL", "container_id": "abc", "netns": "/var/run/netns/x",
                      "args": {"K8S_POD_NAME": "web"}, "ips": ["10.0.0.1/24"]})
    assert isinstance(req, CniRequest) and req.container_id == "abc" and req.ips == ("10.0.0.1/24",)
    for bad, code in (({"command": "ADD", "container_id": "a b"}, 4),
                      ({"command": "ADD", "container_id": "a", "netns": "rel/path"}, 4),
                      ({"command": "ADD", "container_id": "a", "netns": "/x/../y"}, 4),
                      ({"command": "NOPE", "container_id": "a"}, 103),
                      ({"command": "ADD", "container_id": "a", "ips": "10.0.0.1"}, 103)):
        with pytest.raises(CniFailure) as err:
            to_request(bad)
        assert err.value.code == code, bad
