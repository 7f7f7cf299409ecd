"""The config served to the previous Envoy release (agent.envoy.compat)."""

from __future__ import annotations

import json

from envoy.config.listener.v3 import listener_pb2
from google.protobuf.any_pb2 import Any as AnyPb
from google.protobuf.json_format import MessageToJson, Parse

from agent.envoy.bootstrap import build_bootstrap
from agent.envoy.compat import (
    BUILT_FOR,
    LISTENER_NAME_UNAVAILABLE,
    bootstrap_runtime,
    wire_patch,
)
from agent.envoy.resources import LISTENER_TYPE, RawResource, build_namespace_listener
from agent.envoy.xds import _pack


def _listener() -> listener_pb2.Listener:
    lis = build_namespace_listener("default", learn_access_log=True)
    assert "%LISTENER_NAME%" in MessageToJson(lis)  # the formatter 1.39 lacks is in use
    return lis


def test_the_shipped_envoy_gets_the_config_as_built() -> None:
    assert wire_patch(BUILT_FOR) is None
    assert wire_patch((1, 41, 0)) is None
    assert bootstrap_runtime(BUILT_FOR) == {
        "envoy.reloadable_features.enable_send_rst_on_user_space_socket": False}


def test_the_previous_release_gets_the_formatter_replaced_on_the_wire() -> None:
    lis = _listener()
    patch = wire_patch((1, 39, 3))
    assert patch is not None
    patched = listener_pb2.Listener.FromString(patch(lis.SerializeToString()))  # still parses
    # the same as replacing the string in the message itself: nothing else moved
    expect = Parse(MessageToJson(lis).replace(
        "%LISTENER_NAME%", LISTENER_NAME_UNAVAILABLE.decode()), listener_pb2.Listener())
    assert patched == expect
    assert "%LISTENER_NAME%" not in MessageToJson(patched)


def test_pack_applies_the_patch_to_built_and_pre_serialized_resources() -> None:
    lis = _listener()
    patch = wire_patch((1, 39, 0))
    for msg in (lis, RawResource(listener_pb2.Listener, lis.name, lis.SerializeToString())):
        dst = AnyPb()
        _pack(dst, LISTENER_TYPE, msg, patch)
        assert dst.type_url == LISTENER_TYPE
        assert b"%LISTENER_NAME%" not in dst.value and LISTENER_NAME_UNAVAILABLE in dst.value
        plain = AnyPb()
        _pack(plain, LISTENER_TYPE, msg)
        assert b"%LISTENER_NAME%" in plain.value


def test_the_previous_release_gets_no_runtime_guard_it_does_not_know() -> None:
    old = build_bootstrap("n", "/x.sock", "/a.sock", envoy_version=(1, 39, 3))
    new = build_bootstrap("n", "/x.sock", "/a.sock")
    assert old["layered_runtime"]["layers"][0]["static_layer"] == {}
    assert "enable_send_rst_on_user_space_socket" in json.dumps(new["layered_runtime"])
