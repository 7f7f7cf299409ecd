"""Unit tests for the pure xDS resource builder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2

from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    SHARED_CALLERS,
    SO_MARK,
    SOL_SOCKET,
    NodeXdsState,
    PodListener,
    RawResource,
    ResourceBuilder,
    build_namespace_listener,
    build_resources,
    chain_for,
    encode_chains,
    parse_service_cluster_name,
    resource_hash,
    service_cluster_name,
)
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort


def _state(*pods: PodListener) -> NodeXdsState:
    return NodeXdsState(pods=pods)


def _reaches(clusters: dict[str, Any], ns: str) -> str:
    """The internal listener the cluster ``mesh-<ns>`` hands its connections to."""
    (lb,) = clusters[f"mesh-{ns}"].load_assignment.endpoints[0].lb_endpoints
    return str(lb.endpoint.address.envoy_internal_address.server_listener_name)


def _mesh(res: dict[str, dict[str, Any]], name: str = "mesh") -> listener_pb2.Listener:
    """An internal listener (the shared ``mesh`` by default), parsed from the bytes the
    builder serves."""
    raw = res[LISTENER_TYPE][name]
    assert isinstance(raw, RawResource)
    msg = raw.message()
    assert isinstance(msg, listener_pb2.Listener)
    return msg


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
    # constant-size pod listener: hand over to the namespace's internal listener
    assert not lis.filter_chains
    sfs_f, tcp_f = lis.default_filter_chain.filters
    assert sfs_f.name == "envoy.filters.network.set_filter_state"
    sfs = set_filter_state_pb2.Config()
    assert sfs_f.typed_config.Unpack(sfs)
    assert [(v.object_key, v.format_string.text_format_source.inline_string, v.factory_key,
             v.shared_with_upstream) for v in sfs.on_new_connection] == [
        ("envoy.filters.listener.original_dst.local_ip", "%DOWNSTREAM_LOCAL_ADDRESS%", "", 1),
        ("envoy.filters.listener.original_dst.remote_ip", "%DOWNSTREAM_REMOTE_ADDRESS%", "", 1),
        ("aether.capture_listener", "capture-u1", "envoy.string", 1),
        # the golden metrics' source: <namespace>/<workload> (here no workload: the uid)
        ("aether.source", "default/u1", "envoy.string", 1),
        # TRANSITIVE (2): crosses the internal listener to the final upstream's bind
        ("envoy.network.upstream_bind_override.network_namespace", "/var/run/aether/netns/u1",
         "envoy.string", 2)]
    tcp = tcp_proxy_pb2.TcpProxy()
    assert tcp_f.typed_config.Unpack(tcp)
    assert tcp.cluster == "mesh-default"
    # the internal listener: original_dst (restores from filter state) + passthrough default
    mesh = _mesh(res)
    assert mesh.name == "mesh" and mesh.HasField("internal_listener")
    assert not mesh.HasField("address")
    assert [f.name for f in mesh.listener_filters] == ["envoy.filters.listener.original_dst"]
    (flt,) = mesh.default_filter_chain.filters
    assert flt.name == "envoy.filters.network.tcp_proxy"
    tcp = tcp_proxy_pb2.TcpProxy()
    assert flt.typed_config.Unpack(tcp)
    assert (tcp.stat_prefix, tcp.cluster) == ("passthrough_outside", "passthrough")
    # no line per connection unless asked (`--access-log`): it costs more than the proxying
    assert [a.name for a in tcp.access_log] == ["envoy.access_loggers.tcp_grpc"]
    logged = _mesh(build_resources(replace(_state(PodListener("u1", "/n/1")),
                                           connection_log=True)))
    tcp = tcp_proxy_pb2.TcpProxy()
    assert logged.default_filter_chain.filters[0].typed_config.Unpack(tcp)
    assert [a.name for a in tcp.access_log] == ["envoy.access_loggers.tcp_grpc",
                                                "envoy.access_loggers.tcp_grpc"]
    names = []
    for a in tcp.access_log:
        cfg = als_pb2.TcpGrpcAccessLogConfig()
        assert a.typed_config.Unpack(cfg)
        names.append(cfg.common_config.log_name)
    # the access-log report (a JSON record in the agent) and the learning stream
    assert names == ["aether-traffic", "aether-passthrough"]


def test_namespace_cluster_reaches_internal_listener() -> None:
    res = build_resources(_state(PodListener("u1", "/n/1", namespace="shop"),
                                 PodListener("u2", "/n/2", namespace="shop"),
                                 PodListener("u3", "/n/3", namespace="ops")))
    # no namespace has routes of its own: one internal listener for both
    assert sorted(res[LISTENER_TYPE]) == ["capture-u1", "capture-u2", "capture-u3", "mesh"]
    for name in ("mesh-shop", "mesh-ops"):
        c = res[CLUSTER_TYPE][name]
        assert c.type == cluster_pb2.Cluster.STATIC
        assert _reaches(res[CLUSTER_TYPE], name.removeprefix("mesh-")) == "mesh"
    c = res[CLUSTER_TYPE]["mesh-shop"]
    assert c.transport_socket.name == "envoy.transport_sockets.internal_upstream"
    iu = internal_upstream_pb2.InternalUpstreamTransport()
    assert c.transport_socket.typed_config.Unpack(iu)
    assert iu.transport_socket.name == "envoy.transport_sockets.raw_buffer"
    assert sorted(res[CLUSTER_TYPE]) == ["mesh-ops", "mesh-shop", "passthrough"]


def test_pod_listener_size_does_not_depend_on_services() -> None:
    pod = PodListener("p", "/n")
    small = build_resources(_svc_state(pods=(pod,)))
    views = tuple(_view(f"s{i}", ips=(f"10.96.1.{i}",)) for i in range(50))
    big = build_resources(_svc_state(*views, pods=(pod,)))
    assert resource_hash(small[LISTENER_TYPE]["capture-p"]) == resource_hash(
        big[LISTENER_TYPE]["capture-p"])
    assert len(_mesh(big).filter_chains) == 50


def test_namespace_listener_bytes_equal_the_proto() -> None:
    view = _view()
    from agent.envoy.resources import Resilience, TrafficLogs
    chains = [chain_for(view, p, connect_attempts=Resilience().connect_attempts,
                        logs=TrafficLogs())
              for p in view.ports]
    raw = build_resources(_svc_state(view))[LISTENER_TYPE]["mesh"]
    proto = build_namespace_listener(SHARED_CALLERS, chains)
    assert raw.message() == proto
    assert encode_chains([]) == b""


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
    assert list(res[CLUSTER_TYPE]) == ["passthrough"]  # no pods: no namespace listener
    c = res[CLUSTER_TYPE]["passthrough"]
    assert c.type == cluster_pb2.Cluster.ORIGINAL_DST
    assert c.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert c.connect_timeout.ToMilliseconds() == 2500
    _assert_pod_netns_upstream(c, 0xAE)


def _assert_pod_netns_upstream(c: cluster_pb2.Cluster, mark: int) -> None:
    """Upstream sockets: opened in the pod netns named by filter state, marked, and pooled
    per downstream connection so no pooled connection carries two pods' traffic."""
    bind = c.upstream_bind_config
    # wildcard sources: the selector only moves an address that exists into the pod netns
    assert (bind.source_address.address, bind.source_address.port_value) == ("0.0.0.0", 0)
    assert [(a.address.address, a.address.port_value) for a in bind.extra_source_addresses] \
        == [("::", 0)]
    assert bind.local_address_selector.name == \
        "envoy.upstream.local_address_selector.filter_state_override"
    assert bind.local_address_selector.typed_config.type_url.endswith(
        "local_address_selectors.filter_state_override.v3.Config")
    (opt,) = bind.socket_options
    assert (opt.level, opt.name, opt.int_value) == (SOL_SOCKET, SO_MARK, mark)
    assert opt.state == opt.STATE_PREBIND
    assert c.connection_pool_per_downstream_connection


def test_service_clusters_leave_from_the_pod_netns_too() -> None:
    res = build_resources(NodeXdsState(pods=(), services=(_view(),), passthrough_mark=0x4A))
    _assert_pod_netns_upstream(res[CLUSTER_TYPE]["svc|mesh|web|80"].message(), 0x4A)


def test_deterministic_and_sorted() -> None:
    pods = [PodListener(f"u{i}", f"/n/{i}") for i in (3, 1, 2)]
    a = build_resources(_state(*pods))
    b = build_resources(_state(*reversed(pods)))
    assert list(a[LISTENER_TYPE]) == ["capture-u1", "capture-u2", "capture-u3", "mesh"]
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


# ---- Services: chains, EDS clusters, endpoints ---------------------------------------------

SA = "mesh/web-sa"
SAN = "spiffe://cluster.local/ns/mesh/sa/web-sa"


def _ep(ip: str, port: int = 8080, ready: bool = True, draining: bool = False) -> Endpoint:
    return Endpoint(ip, port, SA, ready, draining, SAN, "mesh/web-0")


def _view(name: str = "web", ips: tuple[str, ...] = ("10.96.0.10", "fd00:96::a"),
          ports: tuple[ServicePort, ...] = (ServicePort(80, "http", target_port=8080),),
          eps: Mapping[int, tuple[Endpoint, ...]] | None = None) -> ServiceView:
    return ServiceView(key=f"mesh/{name}", namespace="mesh", name=name, cluster_ips=ips,
                       ports=ports, names=(f"{name}.mesh.svc.cluster.local",),
                       endpoints=dict(eps) if eps is not None else {80: (_ep("10.1.0.5"),)})


def _svc_state(*views: ServiceView, pods: tuple[PodListener, ...] = (PodListener("p", "/n"),)
               ) -> NodeXdsState:
    return NodeXdsState(pods=pods, services=views)


def _chains(lis: Any) -> dict[str, list[tuple[str, int, int]]]:
    if isinstance(lis, RawResource):
        lis = lis.message()
    return {c.name: [(r.address_prefix, r.prefix_len.value, c.filter_chain_match
                      .destination_port.value) for r in c.filter_chain_match.prefix_ranges]
            for c in lis.filter_chains}


def test_naming_roundtrip() -> None:
    assert service_cluster_name("ns", "web", 80) == "svc|ns|web|80"
    assert parse_service_cluster_name("svc|ns|web|80") == ("ns", "web", 80)
    assert parse_service_cluster_name("passthrough") is None
    assert parse_service_cluster_name("svc|ns|web|http") is None


def test_chain_per_service_port_dual_stack_to_eds_cluster() -> None:
    ports = (ServicePort(80, "http", target_port=8080), ServicePort(443, "https"),
             ServicePort(53, "dns", protocol="UDP"))
    res = build_resources(_svc_state(_view(ports=ports)))
    lis = _mesh(res)
    assert _chains(lis) == {
        "svc|mesh|web|80": [("10.96.0.10", 32, 80), ("fd00:96::a", 128, 80)],
        "svc|mesh|web|443": [("10.96.0.10", 32, 443), ("fd00:96::a", 128, 443)],
    }
    chain = lis.filter_chains[0]
    tcp = tcp_proxy_pb2.TcpProxy()
    assert chain.filters[0].typed_config.Unpack(tcp)
    assert tcp.cluster == chain.name
    # the passthrough default chain is unchanged and still there
    assert lis.default_filter_chain.name == "passthrough"
    assert [f.name for f in lis.listener_filters] == ["envoy.filters.listener.original_dst"]
    assert sorted(res[CLUSTER_TYPE]) == ["mesh-default", "passthrough", "svc|mesh|web|443",
                                         "svc|mesh|web|80"]
    assert sorted(res[ENDPOINT_TYPE]) == ["svc|mesh|web|443", "svc|mesh|web|80"]
    c = res[CLUSTER_TYPE]["svc|mesh|web|80"]
    assert c.type == cluster_pb2.Cluster.EDS
    assert c.eds_cluster_config.service_name == "svc|mesh|web|80"
    assert c.eds_cluster_config.eds_config.HasField("ads")
    assert c.common_lb_config.healthy_panic_threshold.value == 0.0
    assert res[ENDPOINT_TYPE]["svc|mesh|web|443"].endpoints == []  # no endpoints for 443


def test_pod_ips_of_a_headless_service_are_meshed_one_pod_each() -> None:
    """A ClusterIP Service's pod addresses get no chain (dialling a pod is not dialling the
    Service); a headless Service's do: each address and target port to a one-host cluster,
    reached whatever the pod's readiness, and the Service stays a backend cluster too."""
    eps = {80: (_ep("10.1.0.5"), _ep("fd00:1::5", ready=False))}
    res = build_resources(_svc_state(_view(eps=eps), _view("db", ips=(), eps=eps)))
    chains = _chains(_mesh(res))
    assert {p for rows in chains.values() for p, _, _ in rows} == {
        "10.96.0.10", "fd00:96::a", "10.1.0.5", "fd00:1::5"}
    assert "svc|mesh|db|80" not in chains
    assert chains["pod|mesh|db|10.1.0.5|8080"] == [("10.1.0.5", 32, 8080)]
    assert chains["pod|mesh|db|fd00:1::5|8080"] == [("fd00:1::5", 128, 8080)]
    assert "svc|mesh|db|80" in res[CLUSTER_TYPE] and "svc|mesh|db|80" in res[ENDPOINT_TYPE]
    one = res[ENDPOINT_TYPE]["pod|mesh|db|fd00:1::5|8080"].message()
    (lb,) = one.endpoints[0].lb_endpoints
    assert health_check_pb2.HealthStatus.Name(lb.health_status) == "HEALTHY"


def test_clashing_cluster_ip_keeps_first_service_only() -> None:
    res = build_resources(_svc_state(_view("a"), _view("b")))
    assert list(_chains(res[LISTENER_TYPE]["mesh"])) == ["svc|mesh|a|80"]


@pytest.mark.parametrize(("ready", "draining", "want"), [
    (True, False, "HEALTHY"), (False, False, "UNHEALTHY"),
    # terminating but still serving: usable, in the fallback priority
    (True, True, "HEALTHY"), (False, True, "DRAINING")])
def test_health_mapping(ready: bool, draining: bool, want: str) -> None:
    eps = {80: (_ep("10.1.0.5", ready=ready, draining=draining),)}
    cla = build_resources(_svc_state(_view(eps=eps)))[ENDPOINT_TYPE]["svc|mesh|web|80"]
    (lb,) = cla.endpoints[0].lb_endpoints
    assert health_check_pb2.HealthStatus.Name(lb.health_status) == want
    assert cla.endpoints[0].priority == 0  # one group: contiguous from 0


def test_terminating_endpoints_serve_only_when_no_ready_one_is_left() -> None:
    """kube-proxy's order: ready endpoints first; serving-but-terminating ones (priority 1)
    only when none is ready; no spill while one ready endpoint remains; a published
    (publishNotReadyAddresses) endpoint counts as ready whatever its state."""
    eps = {80: (_ep("10.1.0.5"), _ep("10.1.0.6", ready=False), _ep("10.1.0.7", draining=True),
                _ep("10.1.0.8", ready=False, draining=True),
                Endpoint("10.1.0.9", 8080, SA, True, True, SAN, "mesh/web-9", always_ready=True))}
    cla = build_resources(_svc_state(_view(eps=eps)))[ENDPOINT_TYPE]["svc|mesh|web|80"]
    groups = {g.priority: {lb.endpoint.address.socket_address.address:
                           health_check_pb2.HealthStatus.Name(lb.health_status)
                           for lb in g.lb_endpoints} for g in cla.endpoints}
    assert groups == {0: {"10.1.0.5": "HEALTHY", "10.1.0.6": "UNHEALTHY", "10.1.0.9": "HEALTHY"},
                      1: {"10.1.0.7": "HEALTHY", "10.1.0.8": "DRAINING"}}
    # 2 of 3 healthy at priority 0 must not spill to the terminating ones
    assert cla.policy.overprovisioning_factor.value >= 100 * 3


def test_endpoint_addresses_sorted_unique_and_without_metadata() -> None:
    eps = {80: (_ep("10.1.0.9", 9090), _ep("10.1.0.5"), _ep("10.1.0.5"), _ep("fd00:1::5"))}
    cla = build_resources(_svc_state(_view(eps=eps)))[ENDPOINT_TYPE]["svc|mesh|web|80"]
    assert isinstance(cla.message(), endpoint_pb2.ClusterLoadAssignment)
    assert cla.cluster_name == "svc|mesh|web|80"
    lbs = cla.endpoints[0].lb_endpoints
    assert [(lb.endpoint.address.socket_address.address,
             lb.endpoint.address.socket_address.port_value) for lb in lbs] == [
        ("10.1.0.5", 8080), ("10.1.0.9", 9090), ("fd00:1::5", 8080)]
    assert not lbs[0].HasField("metadata")  # a Struct per host in Envoy, read by nothing


def _hashes(res: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {t: {n: resource_hash(m) for n, m in r.items()} for t, r in res.items()}


@pytest.mark.parametrize("shared_builder", [True, False])
def test_endpoint_change_alters_only_its_eds_resource(shared_builder: bool) -> None:
    b = ResourceBuilder()
    other = _view("db", ips=("10.96.0.20",))
    a = _hashes(build_resources(_svc_state(_view(), other), b if shared_builder else None))
    moved = _view(eps={80: (_ep("10.1.0.5", draining=True), _ep("10.1.0.6"))})
    z = _hashes(build_resources(_svc_state(moved, other), b if shared_builder else None))
    diff = {(t, n) for t in a for n in set(a[t]) | set(z[t]) if a[t].get(n) != z[t].get(n)}
    assert diff == {(ENDPOINT_TYPE, "svc|mesh|web|80")}


def test_service_add_touches_clusters_eds_and_listeners_only_for_it() -> None:
    b = ResourceBuilder()
    a = _hashes(build_resources(_svc_state(_view()), b))
    z = _hashes(build_resources(_svc_state(_view(), _view("db", ips=("10.96.0.20",))), b))
    diff = {(t, n) for t in a for n in set(a[t]) | set(z[t]) if a[t].get(n) != z[t].get(n)}
    # the pod listener is untouched: only the namespace's internal listener gets the chain
    assert diff == {(CLUSTER_TYPE, "svc|mesh|db|80"), (ENDPOINT_TYPE, "svc|mesh|db|80"),
                    (LISTENER_TYPE, "mesh")}


def test_builder_reuses_protos_and_shares_chains_across_namespaces() -> None:
    b = ResourceBuilder()
    pods = (PodListener("p1", "/n/1", namespace="a"), PodListener("p2", "/n/2", ipv6=False,
                                                                 namespace="b"))
    view = _view()
    r1 = b.build(_svc_state(view, pods=pods))
    # neither namespace has routes of its own: both clusters reach the one shared listener
    assert [n for n in r1[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh"]
    assert [_reaches(r1[CLUSTER_TYPE], ns) for ns in "ab"] == ["mesh", "mesh"]
    # identical inputs: identical objects and dicts (the xDS server memoises by identity)
    r2 = b.build(_svc_state(view, pods=pods))
    for t in r1:
        for n in r1[t]:
            assert r2[t][n] is r1[t][n]
    assert r2[CLUSTER_TYPE] is r1[CLUSTER_TYPE] and r2[ENDPOINT_TYPE] is r1[ENDPOINT_TYPE]
    # endpoints only: listeners and clusters are the same objects, only the CLA is new
    view2 = _view(eps={80: (_ep("10.1.0.7"),)})
    r3 = b.build(_svc_state(view2, pods=pods))
    assert r3[LISTENER_TYPE]["mesh"] is r1[LISTENER_TYPE]["mesh"]
    assert r3[CLUSTER_TYPE] is r1[CLUSTER_TYPE]
    assert r3[ENDPOINT_TYPE]["svc|mesh|web|80"] is not r1[ENDPOINT_TYPE]["svc|mesh|web|80"]
    # a pod added to an existing namespace: one new listener, everything else reused
    r5 = b.build(_svc_state(view2, pods=pods + (PodListener("p3", "/n/3", namespace="a"),)))
    assert [n for n in r5[LISTENER_TYPE] if r5[LISTENER_TYPE][n] is not r3[LISTENER_TYPE].get(n)
            ] == ["capture-p3"]
    assert r5[CLUSTER_TYPE] is r3[CLUSTER_TYPE] and r5[ENDPOINT_TYPE] is r3[ENDPOINT_TYPE]
    # a removed Service leaves everything
    r4 = b.build(_svc_state(pods=pods))
    assert list(r4[CLUSTER_TYPE]) == ["mesh-a", "mesh-b", "passthrough"]
    assert r4[ENDPOINT_TYPE] == {}
    assert len(r4[LISTENER_TYPE]["mesh"].message().filter_chains) == 0


def _consumer_gamma(*namespaces: str) -> Any:
    """GAMMA tables with an HTTPRoute in each of ``namespaces`` on mesh/web:80 (consumer
    routes: they apply to callers in their own namespace only, GEP-1294)."""
    from agent.scope.route_tables import HTTP_ROUTE, build_tables
    from agent.scope.routes import route_from_object
    from agent.scope.services import Service

    svcs = {"mesh/web": Service("mesh", "web", ("10.96.0.10",), (ServicePort(80, "http"),)),
            "mesh/db": Service("mesh", "db", ("10.96.0.20",), (ServicePort(80, "http"),))}
    routes = [route_from_object(HTTP_ROUTE, {
        "metadata": {"name": f"to-db-{ns}", "namespace": ns,
                     "creationTimestamp": "2026-01-01T00:00:00Z", "generation": 1},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web",
                                 "namespace": "mesh", "port": 80}],
                 "rules": [{"backendRefs": [{"name": "db", "namespace": "mesh", "port": 80}]}]}})
        for ns in namespaces]
    return build_tables(routes, svcs)


def test_caller_specific_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace with a consumer route on a port gets its own ``mesh-<ns>`` with its own
    chain there; every other namespace reaches the shared ``mesh``, whose chain for that
    port is the one callers without a route of their own see."""
    import agent.envoy.resources as r

    calls: list[str | None] = []

    def chain(view: ServiceView, port: ServicePort, caller_ns: str | None = None,
              gamma: Any = None, connect_attempts: int = 1, logs: Any = None) -> Any:
        calls.append(caller_ns)
        c = r.service_chain(view, port)
        c.name = f"{c.name}|{caller_ns}"
        return [c]

    monkeypatch.setattr(r, "chain_for", chain)
    pods = (PodListener("p1", "/n/1", namespace="a"), PodListener("p2", "/n/2", namespace="b"),
            PodListener("p3", "/n/3", namespace="c"))
    b = ResourceBuilder()
    views = (_view(), _view("db", ips=("10.96.0.20",)))
    gamma = _consumer_gamma("a")
    res = b.build(replace(_svc_state(*views, pods=pods), gamma=gamma))
    assert [n for n in res[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh", "mesh-a"]
    assert sorted(_chains(res[LISTENER_TYPE]["mesh-a"])) == ["svc|mesh|db|80|None",
                                                             "svc|mesh|web|80|a"]
    assert sorted(_chains(res[LISTENER_TYPE]["mesh"])) == ["svc|mesh|db|80|None",
                                                           f"svc|mesh|web|80|{SHARED_CALLERS}"]

    assert [_reaches(res[CLUSTER_TYPE], ns) for ns in "abc"] == ["mesh-a", "mesh", "mesh"]
    assert sorted(calls, key=str) == ["*", None, "a"]
    b.build(replace(_svc_state(*views, pods=pods), gamma=gamma))
    assert len(calls) == 3  # cached per caller
    assert not b.pending_switch
    # a consumer route appears in b: its listener first, its cluster still on the shared
    # one (pushes go CDS before LDS: a cluster reaching a listener new in the same push
    # would find none until the LDS lands), then, next build, the cluster moves
    both = replace(_svc_state(*views, pods=pods), gamma=_consumer_gamma("a", "b"))
    res2 = b.build(both)
    assert [n for n in res2[LISTENER_TYPE] if n.startswith("mesh")] == [
        "mesh", "mesh-a", "mesh-b"]
    assert [_reaches(res2[CLUSTER_TYPE], ns) for ns in "abc"] == ["mesh-a", "mesh", "mesh"]
    assert b.pending_switch
    res2 = b.build(both)
    assert [_reaches(res2[CLUSTER_TYPE], ns) for ns in "abc"] == ["mesh-a", "mesh-b", "mesh"]
    assert not b.pending_switch
    # the pod listeners are the same objects (a route change never touches them)
    assert all(res2[LISTENER_TYPE][f"capture-{p}"] is res[LISTENER_TYPE][f"capture-{p}"]
               for p in ("p1", "p2", "p3"))
    # every route gone: a and b keep their listeners (now with everyone's chains) while
    # they have pods, since removing a listener closes the connections it carries
    res3 = b.build(_svc_state(*views, pods=pods))
    assert [n for n in res3[LISTENER_TYPE] if n.startswith("mesh")] == [
        "mesh", "mesh-a", "mesh-b"]
    assert [_reaches(res3[CLUSTER_TYPE], ns) for ns in "abc"] == ["mesh-a", "mesh-b", "mesh"]
    assert _chains(res3[LISTENER_TYPE]["mesh-a"]).keys() == _chains(
        res3[LISTENER_TYPE]["mesh"]).keys()
    assert not b.pending_switch
    # b's pods leave and one comes back: b starts on the shared listener again
    b.build(_svc_state(*views, pods=pods[:1] + pods[2:]))
    res4 = b.build(_svc_state(*views, pods=pods))
    assert [n for n in res4[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh", "mesh-a"]
    assert [_reaches(res4[CLUSTER_TYPE], ns) for ns in "abc"] == ["mesh-a", "mesh", "mesh"]


def test_the_shared_listener_stays_while_any_namespace_has_pods() -> None:
    """Only namespace a has pods, and a route of its own: ``mesh`` is there all the same
    (connections made through it before a's move keep their listener), and a keeps
    ``mesh-a`` once its route is gone."""
    b = ResourceBuilder()
    pods = (PodListener("p1", "/n/1", namespace="a"),)
    views = (_view(), _view("db", ips=("10.96.0.20",)))

    res = b.build(_svc_state(*views, pods=pods))
    assert [n for n in res[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh"]
    res = b.build(replace(_svc_state(*views, pods=pods), gamma=_consumer_gamma("a")))
    assert [n for n in res[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh", "mesh-a"]
    assert _reaches(res[CLUSTER_TYPE], "a") == "mesh" and b.pending_switch
    res = b.build(replace(_svc_state(*views, pods=pods), gamma=_consumer_gamma("a")))
    assert _reaches(res[CLUSTER_TYPE], "a") == "mesh-a" and not b.pending_switch
    assert [n for n in res[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh", "mesh-a"]
    res = b.build(_svc_state(*views, pods=pods))
    assert [n for n in res[LISTENER_TYPE] if n.startswith("mesh")] == ["mesh", "mesh-a"]
    assert _reaches(res[CLUSTER_TYPE], "a") == "mesh-a" and not b.pending_switch
    assert b.build(_svc_state(*views, pods=()))[LISTENER_TYPE] == {}


def test_a_refused_listener_holds_the_move() -> None:
    """Envoy NACKed the push carrying a namespace's new listener: its cluster stays on the
    shared one, and the next build offers the listener again."""
    b = ResourceBuilder()
    pods = (PodListener("p1", "/n/1", namespace="a"),)
    state = replace(_svc_state(_view(), _view("db", ips=("10.96.0.20",)), pods=pods),
                    gamma=_consumer_gamma("a"))
    b.build(_svc_state(_view(), _view("db", ips=("10.96.0.20",)), pods=pods))
    b.build(state)
    assert b.pending_switch
    b.hold_moves()
    res = b.build(state)
    assert _reaches(res[CLUSTER_TYPE], "a") == "mesh"
    assert "mesh-a" in res[LISTENER_TYPE] and b.pending_switch

def test_passthrough_grpc_access_log_config() -> None:
    lis = _mesh(build_resources(_svc_state()))
    tcp = tcp_proxy_pb2.TcpProxy()
    assert lis.default_filter_chain.filters[0].typed_config.Unpack(tcp)
    cfg = als_pb2.TcpGrpcAccessLogConfig()
    assert tcp.access_log[0].typed_config.Unpack(cfg)
    cc = cfg.common_config
    assert cc.log_name == "aether-passthrough"
    assert cc.grpc_service.envoy_grpc.cluster_name == "xds"
    assert cc.transport_api_version == 2  # V3
    # the pod listener name travels as filter state; the internal listener's own name too
    assert [(t.tag, t.value) for t in cc.custom_tags] == [
        ("listener", "%FILTER_STATE(aether.capture_listener:PLAIN)%"),
        ("mesh_listener", "%LISTENER_NAME%")]
    off = NodeXdsState(pods=(PodListener("p", "/n"),), learn_access_log=False)
    tcp2 = tcp_proxy_pb2.TcpProxy()
    assert _mesh(build_resources(off)).default_filter_chain.filters[0].typed_config.Unpack(tcp2)
    assert [a.name for a in tcp2.access_log] == []


def _logs(chain: Any) -> list[str]:
    tcp = tcp_proxy_pb2.TcpProxy()
    assert chain.filters[0].typed_config.Unpack(tcp)
    assert tcp.cluster == "passthrough"
    return [a.name for a in tcp.access_log]


def test_learning_streams_only_learnable_cluster_ips_one_chain_per_port() -> None:
    """With the model's learnable targets, only connections to them reach the agent's access
    log; every other passthrough connection streams nothing. A claimed ClusterIP:port (an
    in-scope Service's chain) is never duplicated as a learn chain (Envoy would NACK)."""
    view = _view(ports=(ServicePort(80, "http"),))
    state = replace(_svc_state(view), learn_targets=(
        ("10.96.9.9", 80), ("10.96.9.8", 8080), ("fd00:96::9", 80), ("10.96.0.10", 80)))
    lis = _mesh(build_resources(state))
    assert _chains(lis) == {
        "svc|mesh|web|80": [("10.96.0.10", 32, 80), ("fd00:96::a", 128, 80)],
        "learn-80": [("10.96.9.9", 32, 80), ("fd00:96::9", 128, 80)],
        "learn-8080": [("10.96.9.8", 32, 8080)],
    }
    by_name = {c.name: c for c in lis.filter_chains}
    assert _logs(by_name["learn-80"]) == ["envoy.access_loggers.tcp_grpc"]
    assert _logs(lis.default_filter_chain) == []
    # nothing learnable: no learn chain, and still nothing streamed by the default chain
    none = _mesh(build_resources(replace(state, learn_targets=())))
    assert set(_chains(none)) == {"svc|mesh|web|80"} and _logs(none.default_filter_chain) == []
    # learning off: no learn chains whatever the targets
    off = _mesh(build_resources(replace(state, learn_access_log=False)))
    assert set(_chains(off)) == {"svc|mesh|web|80"}
    # the connection log rides on learn chains too
    logged = _mesh(build_resources(replace(state, connection_log=True)))
    assert _logs({c.name: c for c in logged.filter_chains}["learn-8080"]) == [
        "envoy.access_loggers.tcp_grpc", "envoy.access_loggers.tcp_grpc"]


def test_learn_chains_cached_until_targets_change() -> None:
    from agent.envoy.resources import ResourceBuilder

    b = ResourceBuilder()
    state = replace(_svc_state(_view()), learn_targets=(("10.96.9.9", 80),))
    first = b.build(state)[LISTENER_TYPE]["mesh"]
    assert b.build(replace(state, learn_targets=(("10.96.9.9", 80),)))[LISTENER_TYPE][
        "mesh"] is first
    moved = b.build(replace(state, learn_targets=(("10.96.9.7", 80),)))[LISTENER_TYPE][
        "mesh"]
    assert moved is not first and _chains(moved)["learn-80"] == [("10.96.9.7", 32, 80)]


def test_client_ip_affinity_hashes_the_callers_address_with_maglev() -> None:
    from agent.scope.services import TrafficPolicy, traffic_policy_from_spec
    pol = traffic_policy_from_spec({"sessionAffinity": "ClientIP",
                                    "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                                    "internalTrafficPolicy": "Local",
                                    "publishNotReadyAddresses": True})
    assert pol == TrafficPolicy(client_ip_affinity=True, local_only=True, publish_not_ready=True)
    assert traffic_policy_from_spec({"sessionAffinityConfig": "x"}) == TrafficPolicy()
    view = _view()
    sticky = replace(view, traffic=pol)
    for v, lb, hashed in ((view, "ROUND_ROBIN", False), (sticky, "MAGLEV", True)):
        res = build_resources(_svc_state(v))
        c = res[CLUSTER_TYPE]["svc|mesh|web|80"]
        assert cluster_pb2.Cluster.LbPolicy.Name(c.lb_policy) == lb
        chain = next(c for c in res[LISTENER_TYPE]["mesh"].message().filter_chains
                     if c.name == "svc|mesh|web|80")
        tcp = tcp_proxy_pb2.TcpProxy()
        chain.filters[0].typed_config.Unpack(tcp)
        assert [h.HasField("source_ip") for h in tcp.hash_policy] == ([True] if hashed else [])


def test_resilience_defaults_and_switches() -> None:
    from agent.envoy.resources import Resilience, build_service_cluster, service_chain
    view = _view()
    c = build_service_cluster(view, 80, 1.0)
    od = c.outlier_detection
    assert od.consecutive_5xx.value == 5 and od.base_ejection_time.seconds == 30
    assert od.max_ejection_percent.value == 50 and od.enforcing_success_rate.value == 0
    (t,) = c.circuit_breakers.thresholds
    assert t.max_connections.value == 0xFFFFFFFF  # not Envoy's 1024
    # an ejection reaches the load balancer at once (Envoy's default: merged for 1 s)
    assert c.common_lb_config.HasField("update_merge_window")
    assert c.common_lb_config.update_merge_window.ToNanoseconds() == 0
    assert t.retry_budget.budget_percent.value == 20.0
    off = build_service_cluster(view, 80, 1.0, resilience=Resilience(
        outlier_failures=0, max_connections=500))
    assert not off.HasField("outlier_detection")
    assert off.circuit_breakers.thresholds[0].max_pending_requests.value == 500
    # the pending and concurrent-request limits follow the connection limit unless given
    own = build_service_cluster(view, 80, 1.0, resilience=Resilience(
        max_connections=500, max_pending_requests=7, max_requests=0)).circuit_breakers.thresholds[0]
    assert (own.max_connections.value, own.max_pending_requests.value,
            own.max_requests.value) == (500, 7, 0xFFFFFFFF)
    # the mTLS-tunnel variant keeps one thresholds entry (Envoy wants one per priority)
    assert len(build_service_cluster(view, 80, 1.0, tunnel=True).circuit_breakers.thresholds) == 1
    for attempts, want in ((2, 2), (1, 0)):
        tcp = tcp_proxy_pb2.TcpProxy()
        service_chain(view, view.ports[0], attempts).filters[0].typed_config.Unpack(tcp)
        assert tcp.max_connect_attempts.value == want


def test_preferred_endpoints_come_first_within_each_readiness_tier() -> None:
    near, far = _ep("10.1.0.5"), _ep("10.1.0.6").evolve(preferred=False)
    near_t = _ep("10.1.0.7", draining=True)
    cla = build_resources(_svc_state(_view(eps={80: (near, far, near_t)})))[ENDPOINT_TYPE][
        "svc|mesh|web|80"]
    groups = [[lb.endpoint.address.socket_address.address for lb in g.lb_endpoints]
              for g in sorted(cla.endpoints, key=lambda g: g.priority)]
    assert groups == [["10.1.0.5"], ["10.1.0.6"], ["10.1.0.7"]]
    assert [g.priority for g in cla.endpoints] == [0, 1, 2]


def test_session_persistence_puts_envoys_stateful_session_before_the_router() -> None:
    from envoy.extensions.filters.http.stateful_session.v3 import stateful_session_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.http.stateful_session.cookie.v3 import cookie_pb2

    from agent.scope.services import SessionPersistence, TrafficPolicy

    def hcm_of(view: ServiceView) -> Any:
        mesh = build_resources(_svc_state(view))[LISTENER_TYPE]["mesh"].message()
        (chain,) = [c for c in mesh.filter_chains if c.name.endswith("|http")]
        hcm = hcm_pb2.HttpConnectionManager()
        chain.filters[-1].typed_config.Unpack(hcm)
        return hcm

    port = ServicePort(80, "http", target_port=8080, app_protocol="http")
    plain = hcm_of(_view(ports=(port,)))
    assert [f.name for f in plain.http_filters] == ["envoy.filters.http.router"]
    sticky = replace(_view(ports=(port,)), traffic=TrafficPolicy(
        session=SessionPersistence("Cookie", "shop", 3600.0)))
    hcm = hcm_of(sticky)
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.stateful_session",
                                                  "envoy.filters.http.router"]
    empty = stateful_session_pb2.StatefulSession()
    hcm.http_filters[0].typed_config.Unpack(empty)
    assert not empty.HasField("session_state")  # only routes that keep sessions do
    route, no_match = hcm.route_config.virtual_hosts[0].routes
    per_route = stateful_session_pb2.StatefulSessionPerRoute()
    route.typed_per_filter_config["envoy.filters.http.stateful_session"].Unpack(per_route)
    cfg = per_route.stateful_session
    state = cookie_pb2.CookieBasedSessionState()
    cfg.session_state.typed_config.Unpack(state)
    assert (state.cookie.name, state.cookie.ttl.seconds, state.cookie.path) == ("shop", 3600, "/")
    assert not no_match.typed_per_filter_config
    assert not cfg.strict  # a stale session falls back to the load balancer


def test_a_seeded_builder_keeps_what_the_adopted_envoy_has() -> None:
    """A restarted agent's builder told what its adopted Envoy holds: a namespace whose
    cluster reaches its own listener keeps it (routes gone or not: it carries
    connections), and a namespace that now wants its own listener keeps reaching the
    shared one until a build has offered the new listener."""
    from agent.envoy.adopted import listener_names, namespace_reach

    pods = (PodListener("p1", "/n/1", namespace="a"), PodListener("p2", "/n/2", namespace="b"),
            PodListener("p3", "/n/3", namespace="c"))
    state = NodeXdsState(pods=pods, services=(_view(), _view("db", ips=("10.96.0.20",))),
                         gamma=_consumer_gamma("b"))
    clusters = {"configs": [
        {"cluster": {"name": f"mesh-{ns}", "load_assignment": {"endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": target}}}}]}]}}}
        for ns, target in (("a", "mesh-a"), ("b", "mesh"), ("c", "mesh"))]}
    listeners = {"configs": [{"name": n, "active_state": {}} for n in ("mesh", "mesh-a")]}
    fresh = ResourceBuilder().build(state)
    assert "mesh-a" not in fresh[LISTENER_TYPE]  # unseeded: a's own listener would go
    assert _reaches(fresh[CLUSTER_TYPE], "b") == "mesh-b"  # ... and b move with its listener
    b = ResourceBuilder()
    b.seed(namespace_reach(clusters), listener_names(listeners))
    res = b.build(state)
    assert {"mesh", "mesh-a", "mesh-b"} <= set(res[LISTENER_TYPE])
    assert _reaches(res[CLUSTER_TYPE], "a") == "mesh-a"
    assert _reaches(res[CLUSTER_TYPE], "b") == "mesh"
    assert _reaches(res[CLUSTER_TYPE], "c") == "mesh"
    assert b.pending_switch
    again = b.build(state)
    assert _reaches(again[CLUSTER_TYPE], "b") == "mesh-b" and not b.pending_switch
    assert "mesh-a" in again[LISTENER_TYPE]
    # a listener Envoy already has is moved to at once
    has_b = ResourceBuilder()
    has_b.seed(namespace_reach(clusters), listener_names(
        {"configs": [{"name": n, "active_state": {}} for n in ("mesh", "mesh-a", "mesh-b")]}))
    assert _reaches(has_b.build(state)[CLUSTER_TYPE], "b") == "mesh-b"
    assert not has_b.pending_switch


def test_the_adopted_envoys_dump_is_read_for_namespace_clusters_only() -> None:
    from agent.envoy.adopted import listener_names, namespace_reach
    dump = {"configs": [
        {"cluster": {"name": "mesh-a", "load_assignment": {"endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": "mesh"}}}}]}]}}},
        {"cluster": {"name": "svc|mesh|web|80"}},  # not a namespace cluster
        {"cluster": {"name": "mesh-x", "load_assignment": {}}},  # no internal endpoint
    ]}
    assert namespace_reach(dump) == {"a": "mesh"}
    assert listener_names({"configs": [{"name": "mesh", "active_state": {}},
                                       {"name": "mesh-w", "warming_state": {}}]}) == ["mesh"]
    assert namespace_reach({}) == {} and listener_names({}) == []
    # Envoy's admin matches name_regex against the whole name
    import re

    from agent.envoy import adopted
    assert [n for n in ("mesh-a", "mesh", "mtls|a|b", "svc|mesh-a|x|80")
            if re.fullmatch(adopted.CLUSTERS_REGEX, n)] == ["mesh-a"]
    assert [n for n in ("mesh-a", "mesh", "mtls-out", "capture-x", "meshy")
            if re.fullmatch(adopted.LISTENERS_REGEX, n)] == ["mesh-a", "mesh"]
