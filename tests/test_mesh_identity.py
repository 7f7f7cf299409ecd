"""The identity layer without root: SVIDs from a CA directory, the manager's holding and
renewal rules, and the mTLS xDS pieces the builder emits (#16)."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.capture.policy import ANN_PEER_AUTH, peer_authentication
from agent.envoy import mtls
from agent.envoy.pieces import TRANSITIVE
from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    PodListener,
    ResourceBuilder,
    build_service_cluster,
)
from agent.identity.ca_dir import CaDirProvider, make_ca
from agent.identity.manager import IdentityManager
from agent.identity.svid import IdentityError, Svid, parse_spiffe_id, spiffe_id
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

TD = "cluster.local"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("ca"))
    make_ca(d, TD)
    return d


def test_ca_dir_signs_an_svid_naming_only_the_spiffe_id(ca: str) -> None:
    svid = CaDirProvider(ca, ttl_s=600).issue(spiffe_id(TD, "app", "web"), 1_000_000.0 + 10**9)
    leaf = x509.load_pem_x509_certificate(svid.cert_chain_pem.encode())
    with open(f"{ca}/ca.crt", "rb") as f:
        root = x509.load_pem_x509_certificate(f.read())
    pub = root.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    pub.verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(leaf.signature_hash_algorithm))
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://cluster.local/ns/app/sa/web"]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # lifetime: the TTL from issue (back-dated a minute for skew); renewal at half of it
    assert svid.not_after - svid.issued_at == pytest.approx(600)
    assert svid.renew_at() == pytest.approx(svid.issued_at + 300)


def test_spiffe_id_round_trip_and_rejects() -> None:
    assert parse_spiffe_id(spiffe_id(TD, "a", "b")) == (TD, "a", "b")
    for bad in ("spiffe://td/ns/a", "https://td/ns/a/sa/b", "spiffe://td/ns//sa/b",
                "spiffe:///ns/a/sa/b", "spiffe://td/ns/a/sa/b/c"):
        assert parse_spiffe_id(bad) is None


class FakeProvider:
    name = "fake"

    def __init__(self, ttl: float = 100.0) -> None:
        self.ttl = ttl
        self.calls: list[str] = []
        self.fail = False

    def issue(self, sid: str, now: float) -> Svid:
        self.calls.append(sid)
        if self.fail:
            raise IdentityError("provider down")
        return Svid(sid, f"CERT {sid} {len(self.calls)}", "KEY", now, now + self.ttl, now)

    def bundle_pem(self) -> str:
        return "BUNDLE"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_manager_holds_an_identity_while_a_local_pod_runs_as_it() -> None:
    prov, clock = FakeProvider(), Clock()
    m = IdentityManager(prov, TD, clock=clock)
    assert m.attach("app/web", "app/web-1") is True
    assert m.attach("app/web", "app/web-2") is False  # already held: no second issue
    assert prov.calls == ["spiffe://cluster.local/ns/app/sa/web"]
    tls = m.mesh_tls()
    assert m.mesh_tls() is tls  # the same object while nothing changed
    assert set(tls.svids) == {"app/web"} and tls.bundle_pem == "BUNDLE"
    assert m.detach("app/web", "app/web-1") is False  # web-2 still runs as it
    assert m.detach("app/web", "app/web-2") is True  # the last pod: the key is dropped
    assert m.mesh_tls().svids == {}


def test_manager_renews_at_half_life_and_fails_closed_at_expiry() -> None:
    prov, clock = FakeProvider(ttl=100.0), Clock()
    m = IdentityManager(prov, TD, clock=clock)
    m.attach("app/web", "app/web-1")
    first = m.mesh_tls()
    clock.t += 49
    assert m.renew_due() is False and m.next_due() == pytest.approx(1.0)
    clock.t += 2
    assert m.renew_due() is True and m.rotations == 1
    assert m.mesh_tls() is not first
    assert m.mesh_tls().svids["app/web"].cert_chain_pem.endswith(" 2")
    # the provider fails: the SVID is kept while valid, the error shown, retried
    prov.fail = True
    clock.t += 60
    assert m.renew_due() is False
    st = m.status()
    assert st["svids"][0]["error"] == "provider down" and st["problems"]
    assert m.next_due() == pytest.approx(0.0, abs=60)
    clock.t += 45  # past not_after of the renewed SVID (issued at 1051, valid 100 s)
    assert m.renew_due() is True
    assert "app/web" not in m.mesh_tls().svids  # fail closed: no SVID, no mesh hop
    assert m.status()["svids"][0]["spiffe_id"] is None
    prov.fail = False
    calls = len(prov.calls)
    assert m.renew_due() is False and len(prov.calls) == calls  # retried after a pause only
    assert m.next_due() == pytest.approx(2.0)
    clock.t += 2
    assert m.renew_due() is True and "app/web" in m.mesh_tls().svids


def test_a_failed_first_issue_is_recorded_not_raised() -> None:
    prov = FakeProvider()
    prov.fail = True
    m = IdentityManager(prov, TD, clock=Clock())
    assert m.attach("app/web", "app/web-1") is False
    assert not m.held("app/web")
    assert m.status()["problems"] == ["app/web: provider down"]


def test_peer_authentication_precedence_and_malformed_fails_closed() -> None:
    assert peer_authentication({}, {}) == (False, [])
    assert peer_authentication({}, {ANN_PEER_AUTH: "STRICT "}) == (True, [])
    assert peer_authentication({ANN_PEER_AUTH: "permissive"}, {ANN_PEER_AUTH: "strict"})[0] is False
    strict, problems = peer_authentication({ANN_PEER_AUTH: "stirct"}, {})
    assert strict is True and problems and "strict applies" in problems[0].reason


# ---- xDS ------------------------------------------------------------------------------------

def _svid(identity: str) -> Svid:
    ns, _, sa = identity.partition("/")
    return Svid(spiffe_id(TD, ns, sa), "CERT", "KEY", 0.0, 1e12, 0.0)


def _state(svids: dict[str, Svid] | None, pods: tuple[PodListener, ...]) -> NodeXdsState:
    view = ServiceView(key="app/echo", namespace="app", name="echo", cluster_ips=("10.96.0.10",),
                       ports=(ServicePort(80, "http", "TCP", 8080),), names=(),
                       endpoints={80: (Endpoint("10.1.0.5", 8080, "app/server", True, False,
                                                spiffe_id(TD, "app", "server"), "app/s-1"),)})
    tls = None if svids is None else mtls.MeshTls(TD, svids, "BUNDLE")
    return NodeXdsState(pods=pods, services=(view,), mesh_tls=tls)


CLIENT = PodListener("c1", "/run/netns/c1", namespace="app", service_account="client",
                     ips=("10.1.0.7",))
NOID = PodListener("c2", "/run/netns/c2", namespace="app", service_account="nobody",
                   ips=("10.1.0.8",))


def _msg(r: Any) -> Any:
    return r.message() if hasattr(r, "message") else r


def test_without_identity_nothing_of_the_mesh_hop_exists() -> None:
    out = ResourceBuilder().build(_state(None, (CLIENT,)))
    assert out[mtls.SECRET_TYPE] == {}
    assert not [n for n in out[LISTENER_TYPE] if n.startswith(("inbound", "hbone"))]
    cla = _msg(out[ENDPOINT_TYPE]["svc|app|echo|80"])
    assert cla.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address == "10.1.0.5"


def test_with_identity_service_endpoints_tunnel_with_the_backend_san() -> None:
    out = ResourceBuilder().build(_state({"app/client": _svid("app/client")}, (CLIENT, NOID)))
    assert set(out[mtls.SECRET_TYPE]) == {"svid|app|client", mtls.TRUST_BUNDLE_SECRET}
    lb = _msg(out[ENDPOINT_TYPE]["svc|app|echo|80"]).endpoints[0].lb_endpoints[0]
    internal = lb.endpoint.address.envoy_internal_address
    assert internal.server_listener_name == mtls.MTLS_OUT_LISTENER
    assert internal.endpoint_id == "10.1.0.5:8080"
    md = lb.metadata.filter_metadata
    assert md[mtls.ORIGINAL_DST_METADATA]["local"] == "10.1.0.5:8080"
    assert md[mtls.AETHER_METADATA]["san"] == "spiffe://cluster.local/ns/app/sa/server"
    svc = _msg(out[CLUSTER_TYPE]["svc|app|echo|80"])
    assert svc.transport_socket.name == "envoy.transport_sockets.internal_upstream"
    assert not svc.HasField("upstream_bind_config")
    # one tunnel cluster per identity held, with that identity's certificate, TLS 1.3, h2,
    # and peers of the trust domain only; none for the pod whose SVID is missing
    assert [n for n in out[CLUSTER_TYPE] if n.startswith("mtls|")] == ["mtls|app|client"]
    hb = out[CLUSTER_TYPE]["mtls|app|client"]
    assert hb.original_dst_lb_config.upstream_port_override.value == 15008
    assert hb.upstream_bind_config.local_address_selector.name  # opened in the pod's netns
    from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
    ctx = tls_pb2.UpstreamTlsContext()
    hb.transport_socket.typed_config.Unpack(ctx)
    common = ctx.common_tls_context
    assert [s.name for s in common.tls_certificate_sds_secret_configs] == ["svid|app|client"]
    assert list(common.alpn_protocols) == [mtls.MESH_ALPN]
    san = common.combined_validation_context.default_validation_context \
        .match_typed_subject_alt_names[0]
    assert san.matcher.prefix == "spiffe://cluster.local/"


def _filter_state_keys(listener: Any) -> set[str]:
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    listener.default_filter_chain.filters[0].typed_config.Unpack(cfg)
    return {v.object_key for v in cfg.on_new_connection}


def test_pods_without_an_svid_fail_closed() -> None:
    out = ResourceBuilder().build(_state({"app/client": _svid("app/client")}, (CLIENT, NOID)))
    lis = out[LISTENER_TYPE]
    assert mtls.CALLER_CLUSTER_STATE in _filter_state_keys(lis["capture-c1"])
    # no SVID: its connections reach hbone-out naming no cluster -> the tcp_proxy default,
    # a cluster that does not exist (closed), and it gets no inbound listener
    assert mtls.CALLER_CLUSTER_STATE not in _filter_state_keys(lis["capture-c2"])
    assert "inbound-c1" in lis and "inbound-c2" not in lis
    from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
    tcp = tcp_proxy_pb2.TcpProxy()
    lis[mtls.MTLS_OUT_LISTENER].default_filter_chain.filters[1].typed_config.Unpack(tcp)
    assert tcp.cluster == mtls.NO_IDENTITY_CLUSTER
    assert mtls.NO_IDENTITY_CLUSTER not in out[CLUSTER_TYPE]
    # mtls-out names the destination port in SNI and pins the endpoint's SAN
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    lis[mtls.MTLS_OUT_LISTENER].default_filter_chain.filters[0].typed_config.Unpack(cfg)
    fmt = {v.object_key: v.format_string.text_format_source.inline_string
           for v in cfg.on_new_connection}
    assert fmt[mtls.UPSTREAM_SNI_STATE] == "%DOWNSTREAM_LOCAL_PORT%"
    assert fmt[mtls.UPSTREAM_SAN_STATE] == f"%DYNAMIC_METADATA({mtls.AETHER_METADATA}:san)%"


def test_inbound_terminates_mtls_and_hands_undeclared_ports_to_detection_with_the_ids() -> None:
    tls = mtls.MeshTls(TD, {}, "B")
    lis = mtls.build_inbound_listener("c1", "/run/netns/c1", "app/client", ("10.1.0.7", "fd00::7"),
                                      tls, forbidden_ports=(15001,))
    from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
    from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
    by_name = {c.name: c for c in lis.filter_chains}
    assert set(by_name) == {f"{c}-v{f}" for f in "46"
                            for c in ("own-ports", "mtls", "mtls-http", "mtls-tcp")}
    # every chain names its family's range (Envoy narrows on the address before the name)
    assert all(len(c.filter_chain_match.prefix_ranges) == 1 for c in lis.filter_chains)
    deny = by_name["own-ports-v4"]
    assert sorted(deny.filter_chain_match.server_names) == ["15001", "15008"]
    closing = tcp_proxy_pb2.TcpProxy()
    deny.filters[0].typed_config.Unpack(closing)
    assert closing.cluster == mtls.NO_IDENTITY_CLUSTER
    chain = by_name["mtls-v4"]
    assert list(chain.filter_chain_match.application_protocols) == [mtls.MESH_ALPN]
    down = tls_pb2.DownstreamTlsContext()
    chain.transport_socket.typed_config.Unpack(down)
    assert down.require_client_certificate.value is True
    tcp = tcp_proxy_pb2.TcpProxy()
    chain.filters[1].typed_config.Unpack(tcp)
    # after the handshake, to the node's detection listener, with both identities
    assert tcp.cluster == mtls.INBOUND_DETECT
    assert tcp.upstream_connect_mode == tcp_proxy_pb2.ON_DOWNSTREAM_TLS_HANDSHAKE
    assert {t.type: t.format_string.text_format_source.inline_string
            for t in tcp.proxy_protocol_tlvs} == {
        mtls.PEER_ID_TLV: "%DOWNSTREAM_PEER_URI_SAN%",
        mtls.LOCAL_ID_TLV: "%DOWNSTREAM_LOCAL_URI_SAN%"}
    # where to deliver crosses the internal listener as filter state: the pod's own
    # address (v4 first), the port the caller named, the pod's netns
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    chain.filters[0].typed_config.Unpack(cfg)
    values = {v.object_key: v for v in cfg.on_new_connection}
    assert values[mtls.ORIGINAL_DST_ADDRESS_STATE].format_string.text_format_source \
        .inline_string == "10.1.0.7:%REQUESTED_SERVER_NAME%"
    assert values[mtls.UPSTREAM_NETNS_STATE].format_string.text_format_source \
        .inline_string == "/run/netns/c1"
    assert {v.shared_with_upstream for v in values.values()} == {TRANSITIVE}
    assert lis.address.socket_address.network_namespace_filepath == "/run/netns/c1"
    assert lis.address.socket_address.port_value == 15008
    # the server offers every hop ALPN; the caller's one picks the chain
    assert list(down.common_tls_context.alpn_protocols) == list(mtls.MESH_ALPNS)


def _state_formats(filter_: Any) -> dict[str, str]:
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    filter_.typed_config.Unpack(cfg)
    return {v.object_key: v.format_string.text_format_source.inline_string
            for v in cfg.on_new_connection}


def test_declared_protocols_skip_the_detection_hop() -> None:
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
    lis = mtls.build_inbound_listener("c1", "/run/netns/c1", "app/server", ("fd00::7",),
                                      mtls.MeshTls(TD, {}, "B"), ipv4=False)
    by_name = {c.name: c for c in lis.filter_chains}
    assert set(by_name) == {"own-ports-v6", "mtls-v6", "mtls-http-v6", "mtls-tcp-v6"}
    http, tcp = by_name["mtls-http-v6"], by_name["mtls-tcp-v6"]
    assert list(http.filter_chain_match.application_protocols) == [mtls.MESH_ALPN_HTTP]
    assert list(tcp.filter_chain_match.application_protocols) == [mtls.MESH_ALPN_TCP]
    for chain in (http, tcp):
        # delivered to the pod's own address, the port from the server name, in its netns
        fmt = _state_formats(chain.filters[0])
        assert fmt[mtls.ORIGINAL_DST_ADDRESS_STATE] == "[fd00::7]:%REQUESTED_SERVER_NAME%"
        assert fmt[mtls.UPSTREAM_NETNS_STATE] == "/run/netns/c1"
    hcm = hcm_pb2.HttpConnectionManager()
    http.filters[1].typed_config.Unpack(hcm)
    assert hcm.forward_client_cert_details == hcm_pb2.HttpConnectionManager.SANITIZE
    route = hcm.route_config.virtual_hosts[0].routes[0]
    assert route.route.cluster == mtls.INBOUND_DELIVER_CLUSTER
    assert route.request_headers_to_add[0].header.value == (
        "By=%DOWNSTREAM_LOCAL_URI_SAN%;URI=%DOWNSTREAM_PEER_URI_SAN%")
    # picked by the offered ALPN, none negotiated: the codec sniffs h2c from the preface
    from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
    down = tls_pb2.DownstreamTlsContext()
    http.transport_socket.typed_config.Unpack(down)
    assert not down.common_tls_context.alpn_protocols
    proxy = tcp_proxy_pb2.TcpProxy()
    tcp.filters[1].typed_config.Unpack(proxy)
    assert proxy.cluster == mtls.INBOUND_DELIVER_CLUSTER
    # no connection to the application before the caller is authenticated
    assert proxy.upstream_connect_mode == tcp_proxy_pb2.ON_DOWNSTREAM_TLS_HANDSHAKE


def test_the_hop_alpn_follows_the_service_ports_app_protocol() -> None:
    assert mtls.hop_alpn("http") == mtls.MESH_ALPN_HTTP
    assert mtls.hop_alpn("tcp") == mtls.MESH_ALPN_TCP
    assert mtls.hop_alpn("detect") == mtls.MESH_ALPN
    ports = (ServicePort(80, "web", "TCP", 8080, "http"), ServicePort(5432, "db", "TCP", 5432, "postgresql"),
             ServicePort(9000, "x", "TCP", 9000, None))
    view = ServiceView("app/srv", "app", "srv", ("10.96.0.10",), ports, ("srv",))
    from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2
    for port, alpn in ((80, mtls.MESH_ALPN_HTTP), (5432, mtls.MESH_ALPN_TCP), (9000, mtls.MESH_ALPN)):
        c = build_service_cluster(view, port, 1.0, tunnel=True)
        assert dict(c.metadata.filter_metadata[mtls.HOP_METADATA]) == {"alpn": alpn}
        iu = internal_upstream_pb2.InternalUpstreamTransport()
        c.transport_socket.typed_config.Unpack(iu)
        assert [(m.name, m.kind.WhichOneof("kind")) for m in iu.passthrough_metadata] == [
            (mtls.ORIGINAL_DST_METADATA, "host"), (mtls.AETHER_METADATA, "host"),
            (mtls.HOP_METADATA, "cluster")]
    # mtls-out turns it into the upstream ALPN
    fmt = _state_formats(mtls.build_mtls_out_listener().default_filter_chain.filters[0])
    assert fmt[mtls.APPLICATION_PROTOCOLS_STATE] == f"%DYNAMIC_METADATA({mtls.HOP_METADATA}:alpn)%"


def test_detection_is_one_internal_listener_that_delivers_where_the_inbound_side_said() -> None:
    """Nothing per pod in it: the address, port and netns come with the connection (set by
    the pod's inbound listener), the identities in the PROXY header; no pod can reach it."""
    from envoy.extensions.filters.listener.proxy_protocol.v3 import proxy_protocol_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
    lis = mtls.build_inbound_detect_listener()
    assert lis.name == mtls.INBOUND_DETECT
    assert lis.HasField("internal_listener") and not lis.HasField("address")
    assert [f.name for f in lis.listener_filters] == [
        "envoy.filters.listener.proxy_protocol", "envoy.filters.listener.http_inspector"]
    pp = proxy_protocol_pb2.ProxyProtocol()
    lis.listener_filters[0].typed_config.Unpack(pp)
    assert {r.tlv_type: r.on_tlv_present.key for r in pp.rules} == {
        mtls.PEER_ID_TLV: "peer", mtls.LOCAL_ID_TLV: "local"}
    (http,) = lis.filter_chains
    assert list(http.filter_chain_match.application_protocols) == ["http/1.1", "h2c"]
    hcm = hcm_pb2.HttpConnectionManager()
    http.filters[0].typed_config.Unpack(hcm)
    route = hcm.route_config.virtual_hosts[0].routes[0]
    assert route.route.cluster == mtls.INBOUND_DELIVER_CLUSTER
    assert route.request_headers_to_add[0].header.value == (
        f"By=%FILTER_STATE({mtls.PROXY_TLV_STATE}:FIELD:local)%;"
        f"URI=%FILTER_STATE({mtls.PROXY_TLV_STATE}:FIELD:peer)%")
    assert hcm.forward_client_cert_details == hcm_pb2.HttpConnectionManager.SANITIZE
    proxy = tcp_proxy_pb2.TcpProxy()
    lis.default_filter_chain.filters[0].typed_config.Unpack(proxy)
    assert proxy.cluster == mtls.INBOUND_DELIVER_CLUSTER
    # no chain sets an address of its own: only what the inbound listener set is used
    assert all(f.name != "envoy.filters.network.set_filter_state"
               for c in (http, lis.default_filter_chain) for f in c.filters)
    c = mtls.build_inbound_detect_cluster(2.0)
    (ep,) = c.load_assignment.endpoints[0].lb_endpoints
    assert ep.endpoint.address.envoy_internal_address.server_listener_name == mtls.INBOUND_DETECT
    from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2
    iu = internal_upstream_pb2.InternalUpstreamTransport()
    c.transport_socket.typed_config.Unpack(iu)
    assert iu.transport_socket.name == "envoy.transport_sockets.upstream_proxy_protocol"


def test_an_svid_coming_rebuilds_only_its_identitys_pod_listeners() -> None:
    """The builder keeps pod listeners by difference: an SVID issued for one identity
    rebuilds that identity's pods (now with their inbound listeners), the other pods'
    listeners stay the very same objects; a pod leaving drops only its own."""
    b = ResourceBuilder()
    client = {"app/client": _svid("app/client")}
    first = b.build(_state(client, (CLIENT, NOID)))[LISTENER_TYPE]
    assert mtls.inbound_listener_name("c1") in first
    assert mtls.inbound_listener_name("c2") not in first
    both = b.build(_state({**client, "app/nobody": _svid("app/nobody")}, (CLIENT, NOID)))[
        LISTENER_TYPE]
    assert both[CLIENT.listener_name] is first[CLIENT.listener_name]
    assert both[mtls.inbound_listener_name("c1")] is first[mtls.inbound_listener_name("c1")]
    assert both[NOID.listener_name] is not first[NOID.listener_name]
    assert mtls.inbound_listener_name("c2") in both
    alone = b.build(_state({**client, "app/nobody": _svid("app/nobody")}, (CLIENT,)))[
        LISTENER_TYPE]
    assert not [n for n in alone if "c2" in n]
    assert alone[CLIENT.listener_name] is first[CLIENT.listener_name]
    again = b.build(_state({**client, "app/nobody": _svid("app/nobody")}, (CLIENT,)))[
        LISTENER_TYPE]
    assert again is alone  # nothing changed: the same dict (the xDS server skips the type)
    from agent.envoy.resources import resource_hash
    pre_dict, hashes = b.prehashed[LISTENER_TYPE]
    assert pre_dict is alone and hashes == {n: resource_hash(m) for n, m in alone.items()}


def test_a_renewed_svid_changes_its_secret_and_nothing_else() -> None:
    """A renewal swaps the certificate under the same identity: only the Secret is pushed.
    Rebuilding the inbound listener or the caller cluster would drain connections mid-stream
    at every rotation (#16: rotation drops no request)."""
    from agent.envoy.resources import ResourceBuilder
    b = ResourceBuilder()
    old = b.build(_state({"app/client": _svid("app/client")}, (CLIENT,)))
    renewed = Svid(spiffe_id(TD, "app", "client"), "CERT-2", "KEY-2", 10.0, 2e12, 10.0)
    new = b.build(_state({"app/client": renewed}, (CLIENT,)))
    for kind in (LISTENER_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE):
        assert new[kind].keys() == old[kind].keys()
        assert all(new[kind][n] is old[kind][n] for n in new[kind]), kind
    assert new[mtls.SECRET_TYPE]["svid|app|client"] != old[mtls.SECRET_TYPE]["svid|app|client"]


def test_ca_dir_records_the_validity_the_certificate_carries(ca: str) -> None:
    """X.509 times have whole seconds: the recorded expiry is the certificate's own (rounded
    down), never later, so a renewal at half life is never late."""
    now = 1_000_000.75 + 10**9
    svid = CaDirProvider(ca, ttl_s=6).issue(spiffe_id(TD, "app", "web"), now)
    leaf = x509.load_pem_x509_certificate(svid.cert_chain_pem.encode())
    assert svid.not_after == leaf.not_valid_after_utc.timestamp()
    assert svid.not_before == leaf.not_valid_before_utc.timestamp()
    assert now + 5 <= svid.not_after <= now + 6
