"""Property tests: the agent-side CNI request parser never raises on arbitrary envelopes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.cni import request as r

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                        children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300)
@given(st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_parse_never_raises_on_arbitrary_envelopes(env: dict[str, Any]) -> None:
    early, req = r.parse(env)
    assert early is not None or req["command"] in ("ADD", "DEL", "CHECK")
    if early is not None:
        rc, out = early
        assert rc in (0, 1)
        json.loads(out)


@settings(max_examples=300)
@given(st.sampled_from(["ADD", "DEL", "CHECK", "VERSION", "GC", ""]),
       st.dictionaries(st.sampled_from(["cniVersion", "prevResult", "agent_socket", "name",
                                        "capture_redirect_all_default"]), json_values, max_size=5),
       st.text(max_size=60))
def test_parse_cni_shapes(command: str, netconf: dict[str, Any], args: str) -> None:
    env = {"env": {"CNI_COMMAND": command, "CNI_CONTAINERID": "c1", "CNI_NETNS": "/x",
                   "CNI_ARGS": args}, "stdin": netconf}
    early, req = r.parse(env)
    if early is None:
        assert isinstance(req["args"], dict) and isinstance(req["ips"], list)
        rc, out = r.render(req, {"ok": False, "code": 101, "msg": "x"})
        assert rc == 1 and json.loads(out)["code"] == 101
