"""Unit tests for the pure xDS resource builder."""

from __future__ import annotations

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

from agent.envoy.resources import (
    CLUSTER_TYPE,
    LISTENER_TYPE,
    SO_MARK,
    SOL_SOCKET,
    NodeXdsState,
    PodListener,
    build_resources,
    resource_hash,
)


def _state(*pods: PodListener) -> NodeXdsState:
    return NodeXdsState(pods=pods)


def test_listener_per_pod_bound_in_netns_v4_and_v6() -> None:
    res = build_resources(_state(PodListener("u1", "/var/run/aether/netns/u1")))
    lis = res[LISTENER_TYPE]["capture-u1"]
    assert lis.name == "capture-u1"
    assert lis.bind_to_port.value is True
    sa = lis.address.socket_address
    assert (sa.address, sa.port_value) == ("127.0.0.1", 15001)
    assert sa.network_namespace_filepath == "/var/run/aether/netns/u1"
    assert len(lis.additional_addresses) == 1
    sa6 = lis.additional_addresses[0].address.socket_address
    assert (sa6.address, sa6.port_value) == ("::1", 15001)
    assert sa6.network_namespace_filepath == "/var/run/aether/netns/u1"
    assert [f.name for f in lis.listener_filters] == ["envoy.filters.listener.original_dst"]
    (flt,) = lis.default_filter_chain.filters
    assert flt.name == "envoy.filters.network.tcp_proxy"
    tcp = tcp_proxy_pb2.TcpProxy()
    assert flt.typed_config.Unpack(tcp)
    assert (tcp.stat_prefix, tcp.cluster) == ("passthrough", "passthrough")
    assert [a.name for a in tcp.access_log] == ["envoy.access_loggers.stdout",
                                                "envoy.access_loggers.tcp_grpc"]


@pytest.mark.parametrize(("v4", "v6", "want"), [(True, False, ["127.0.0.1"]),
                                                (False, True, ["::1"])])
def test_single_family(v4: bool, v6: bool, want: list[str]) -> None:
    st = NodeXdsState(pods=(PodListener("u", "/n", ipv4=v4, ipv6=v6),), capture_port=16001)
    lis = build_resources(st)[LISTENER_TYPE]["capture-u"]
    addrs = [lis.address] + [a.address for a in lis.additional_addresses]
    assert [a.socket_address.address for a in addrs] == want
    assert all(a.socket_address.port_value == 16001 for a in addrs)


def test_no_family_rejected() -> None:
    with pytest.raises(ValueError):
        build_resources(_state(PodListener("u", "/n", ipv4=False, ipv6=False)))


def test_duplicate_uid_rejected() -> None:
    with pytest.raises(ValueError):
        build_resources(_state(PodListener("u", "/a"), PodListener("u", "/b")))


def test_passthrough_cluster_original_dst_with_so_mark() -> None:
    st = NodeXdsState(pods=(), passthrough_mark=0xAE, connect_timeout_s=2.5)
    res = build_resources(st)
    assert res[LISTENER_TYPE] == {}
    c = res[CLUSTER_TYPE]["passthrough"]
    assert c.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert c.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert c.connect_timeout.ToMilliseconds() == 2500
    bind = c.upstream_bind_config
    assert not bind.HasField("source_address")  # no bind: v4 and v6 upstreams both work
    (opt,) = bind.socket_options
    assert (opt.level, opt.name, opt.int_value) == (SOL_SOCKET, SO_MARK, 0xAE)
    assert opt.state == opt.STATE_PREBIND


def test_deterministic_and_sorted() -> None:
    pods = [PodListener(f"u{i}", f"/n/{i}") for i in (3, 1, 2)]
    a = build_resources(_state(*pods))
    b = build_resources(_state(*reversed(pods)))
    assert list(a[LISTENER_TYPE]) == ["capture-u1", "capture-u2", "capture-u3"]
    for t in (LISTENER_TYPE, CLUSTER_TYPE):
        assert list(a[t]) == list(b[t])
        for name in a[t]:
            assert a[t][name].SerializeToString(deterministic=True) == b[t][
                name
            ].SerializeToString(deterministic=True)
            assert resource_hash(a[t][name]) == resource_hash(b[t][name])


def test_hash_changes_with_content() -> None:
    a = build_resources(_state(PodListener("u", "/n/a")))[LISTENER_TYPE]["capture-u"]
    b = build_resources(_state(PodListener("u", "/n/b")))[LISTENER_TYPE]["capture-u"]
    assert resource_hash(a) != resource_hash(b)
