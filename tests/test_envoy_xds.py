"""xDS server protocol tests with a real gRPC client over a unix socket."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from agent.envoy.als import parse_message
from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    PodListener,
)
from agent.envoy.xds import XdsServer
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

TIMEOUT = 5.0


def _state(*uids: str) -> NodeXdsState:
    return NodeXdsState(pods=tuple(PodListener(u, f"/var/run/netns/{u}") for u in uids))


class Client:
    """Drives one ADS stream: ``send`` requests, ``recv`` responses."""

    def __init__(self, path: str, delta: bool) -> None:
        self.chan = grpc.insecure_channel("unix:" + path)
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.chan)
        self.reqs: queue.Queue[Any] = queue.Queue()
        call = stub.DeltaAggregatedResources if delta else stub.StreamAggregatedResources
        self.resps = call(self._gen())
        self.inbox: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for r in self.resps:
                self.inbox.put(r)
        except grpc.RpcError:
            pass

    def _gen(self) -> Iterator[Any]:
        while True:
            r = self.reqs.get()
            if r is None:
                return
            yield r

    def send(self, req: Any) -> None:
        self.reqs.put(req)

    def recv(self, timeout: float = TIMEOUT) -> Any:
        return self.inbox.get(timeout=timeout)

    def close(self) -> None:
        self.reqs.put(None)
        self.chan.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[XdsServer]:
    s = XdsServer(str(tmp_path / "xds.sock"))
    s.start()
    yield s
    s.stop(0.1)


def _sotw_req(t: str, version: str = "", nonce: str = "", err: str | None = None,
              names: tuple[str, ...] = ()) -> Any:
    r = discovery_pb2.DiscoveryRequest(type_url=t, version_info=version, response_nonce=nonce,
                                       resource_names=names)
    r.node.id = "test-node"
    if err is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=err))
    return r


def _delta_req(t: str, nonce: str = "", err: str | None = None,
               initial: dict[str, str] | None = None, sub: tuple[str, ...] = (),
               unsub: tuple[str, ...] = ()) -> Any:
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=t, response_nonce=nonce,
                                            initial_resource_versions=initial or {},
                                            resource_names_subscribe=sub,
                                            resource_names_unsubscribe=unsub)
    r.node.id = "test-node"
    if err is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=err))
    return r


def _names(resp: Any) -> list[str]:
    out = []
    for a in resp.resources:
        lis = listener_pb2.Listener()
        if a.Unpack(lis):
            out.append(lis.name)
    return out


def test_sotw_ack_nack_and_stale_nonce(server: XdsServer) -> None:
    v1 = server.set_state(_state("a"))
    c = Client(server.socket_path, delta=False)
    try:
        c.send(_sotw_req(CLUSTER_TYPE))
        cds = c.recv()
        assert cds.type_url == CLUSTER_TYPE and cds.version_info == v1 and cds.nonce
        c.send(_sotw_req(CLUSTER_TYPE, cds.version_info, cds.nonce))
        c.send(_sotw_req(LISTENER_TYPE))
        lds = c.recv()
        assert _names(lds) == ["capture-a", "mesh"] and lds.version_info == v1
        assert not server.wait_acked(v1, 0.2)  # LDS not yet ACKed
        c.send(_sotw_req(LISTENER_TYPE, lds.version_info, lds.nonce))
        assert server.wait_acked(v1, TIMEOUT)

        # A change pushes the full LDS set (unchanged CDS is not re-sent).
        v2 = server.set_state(_state("a", "b"))
        lds2 = c.recv()
        assert lds2.type_url == LISTENER_TYPE
        assert _names(lds2) == ["capture-a", "capture-b", "mesh"]
        assert lds2.nonce != lds.nonce
        # Stale nonce with an "ACK" must not count.
        c.send(_sotw_req(LISTENER_TYPE, v2, lds.nonce))
        assert not server.wait_acked(v2, 0.3)
        # NACK: reported, counted, not re-pushed.
        c.send(_sotw_req(LISTENER_TYPE, v1, lds2.nonce, err="bad listener"))
        assert not server.wait_acked(v2, 0.3)
        st = server.status()
        assert st["nack_count"] == 1
        assert st["last_nack"]["error_detail"] == "bad listener"
        assert st["last_nack"]["version"] == v2
        assert st["last_nack"]["type_url"] == LISTENER_TYPE
        assert st["acked"][LISTENER_TYPE] == v1
        with pytest.raises(queue.Empty):
            c.recv(0.5)
        # Next good state is pushed and ACKed; wait_acked is ">= version".
        v3 = server.set_state(_state("a"))
        lds3 = c.recv()
        c.send(_sotw_req(LISTENER_TYPE, lds3.version_info, lds3.nonce))
        assert server.wait_acked(v3, TIMEOUT)
        assert server.wait_acked(v2, 0.1) and server.wait_acked(v1, 0.1)
        assert server.status()["connected_streams"] == 1
    finally:
        c.close()


def test_delta_adds_one_listener_and_removes(server: XdsServer) -> None:
    server.set_state(_state("a", "b"))
    c = Client(server.socket_path, delta=True)
    try:
        c.send(_delta_req(CLUSTER_TYPE))
        cds = c.recv()
        assert [r.name for r in cds.resources] == ["mesh-default", "passthrough"]
        c.send(_delta_req(CLUSTER_TYPE, cds.nonce))
        c.send(_delta_req(LISTENER_TYPE))
        lds = c.recv()
        assert [r.name for r in lds.resources] == ["capture-a", "capture-b", "mesh"]
        c.send(_delta_req(LISTENER_TYPE, lds.nonce))

        v = server.set_state(_state("a", "b", "c"))
        add = c.recv()
        assert add.type_url == LISTENER_TYPE
        assert [r.name for r in add.resources] == ["capture-c"]
        assert list(add.removed_resources) == []
        assert add.system_version_info == v
        c.send(_delta_req(LISTENER_TYPE, add.nonce))
        assert server.wait_acked(v, TIMEOUT)

        v = server.set_state(_state("a", "c"))
        rm = c.recv()
        assert list(rm.resources) == []
        assert list(rm.removed_resources) == ["capture-b"]
        c.send(_delta_req(LISTENER_TYPE, rm.nonce, err="nope"))
        assert not server.wait_acked(v, 0.2)
        assert server.status()["nack_count"] == 1
    finally:
        c.close()


def test_delta_initial_resource_versions_honoured(server: XdsServer) -> None:
    server.set_state(_state("a", "b"))
    c = Client(server.socket_path, delta=True)
    c.send(_delta_req(LISTENER_TYPE))
    first = c.recv()
    have = {r.name: r.version for r in first.resources}
    c.close()

    # Reconnect (e.g. agent restart) declaring what Envoy still holds, one of them stale
    # and one that no longer exists.
    server.set_state(_state("a", "c"))
    c2 = Client(server.socket_path, delta=True)
    try:
        init = {"capture-a": have["capture-a"], "capture-b": have["capture-b"],
                "mesh": have["mesh"]}
        c2.send(_delta_req(LISTENER_TYPE, initial=init))
        resp = c2.recv()
        assert [r.name for r in resp.resources] == ["capture-c"]
        assert list(resp.removed_resources) == ["capture-b"]

        # Everything already current: an empty (but present) response so init completes.
        c2.send(_delta_req(CLUSTER_TYPE))
        cds = c2.recv()
        c3 = Client(server.socket_path, delta=True)
        try:
            c3.send(_delta_req(CLUSTER_TYPE, initial={r.name: r.version
                                                      for r in cds.resources}))
            empty = c3.recv()
            assert list(empty.resources) == [] and list(empty.removed_resources) == []
            assert empty.nonce
        finally:
            c3.close()
    finally:
        c2.close()


def test_wait_acked_timeout_without_client(server: XdsServer) -> None:
    v = server.set_state(_state("a"))
    assert server.wait_acked(v, 0.1) is False
    with pytest.raises(ValueError):
        server.wait_acked("999", 0.1)
    st = server.status()
    assert st["last_pushed_version"] == v and st["connected_streams"] == 0


def test_unchanged_state_is_not_repushed(server: XdsServer) -> None:
    server.set_state(_state("a"))
    c = Client(server.socket_path, delta=False)
    try:
        for t in (CLUSTER_TYPE, LISTENER_TYPE):
            c.send(_sotw_req(t))
            r = c.recv()
            c.send(_sotw_req(t, r.version_info, r.nonce))
        v2 = server.set_state(_state("a"))
        with pytest.raises(queue.Empty):
            c.recv(0.5)
        # Nothing changed, so the earlier ACKs satisfy the new version.
        assert server.wait_acked(v2, TIMEOUT)
    finally:
        c.close()


def test_stale_socket_from_crashed_agent_is_replaced(tmp_path: Path) -> None:
    import socket

    path = str(tmp_path / "xds.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # file remains, nobody listening
    s = XdsServer(path)
    s.start()
    try:
        with pytest.raises(RuntimeError, match="in use"):
            XdsServer(path).start()
    finally:
        s.stop(0.1)


# ---- EDS -------------------------------------------------------------------------------

WEB, DB = "svc|mesh|web|80", "svc|mesh|db|80"


def _view(name: str, cip: str, *ips: str, draining: bool = False) -> ServiceView:
    # draining: terminating and no longer serving (a terminating pod that still serves is
    # as usable as a ready one when it is all there is)
    eps = tuple(Endpoint(ip, 8080, "mesh/sa", not draining, draining) for ip in ips)
    return ServiceView(key=f"mesh/{name}", namespace="mesh", name=name, cluster_ips=(cip,),
                       ports=(ServicePort(80),), names=(), endpoints={80: eps})


def _mesh(web: tuple[str, ...] = ("10.1.0.1",), db: bool = True, draining: bool = False
          ) -> NodeXdsState:
    views = [_view("web", "10.96.0.1", *web, draining=draining)]
    if db:
        views.append(_view("db", "10.96.0.2", "10.1.0.9"))
    return NodeXdsState(pods=(PodListener("a", "/var/run/netns/a"),), services=tuple(views))


def _until(pred: Any, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _cla_names(resp: Any) -> list[str]:
    out = []
    for r in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert (r.resource if hasattr(r, "resource") else r).Unpack(cla)
        out.append(cla.cluster_name)
    return out


def _cla_ips(resp: Any) -> list[str]:
    cla = endpoint_pb2.ClusterLoadAssignment()
    r = resp.resources[0]
    assert (r.resource if hasattr(r, "resource") else r).Unpack(cla)
    return [lb.endpoint.address.socket_address.address for lb in cla.endpoints[0].lb_endpoints]


def test_delta_eds_by_name_endpoint_change_pushes_only_eds(server: XdsServer) -> None:
    server.set_state(_mesh())
    c = Client(server.socket_path, delta=True)
    try:
        c.send(_delta_req(CLUSTER_TYPE))
        cds = c.recv()
        assert sorted(r.name for r in cds.resources) == ["mesh-default", "passthrough", DB, WEB]
        c.send(_delta_req(CLUSTER_TYPE, cds.nonce))
        c.send(_delta_req(ENDPOINT_TYPE, sub=(WEB,)))
        eds = c.recv()
        assert eds.type_url == ENDPOINT_TYPE and _cla_names(eds) == [WEB]  # only what was asked
        c.send(_delta_req(ENDPOINT_TYPE, eds.nonce))
        # a later subscription (ack-less, as Envoy sends it) adds just that name
        c.send(_delta_req(ENDPOINT_TYPE, sub=(DB,)))
        eds2 = c.recv()
        assert _cla_names(eds2) == [DB]
        c.send(_delta_req(ENDPOINT_TYPE, eds2.nonce))
        c.send(_delta_req(LISTENER_TYPE))
        lds = c.recv()
        c.send(_delta_req(LISTENER_TYPE, lds.nonce))

        v = server.set_state(_mesh(web=("10.1.0.1", "10.1.0.2")))
        upd = c.recv()
        assert upd.type_url == ENDPOINT_TYPE and _cla_names(upd) == [WEB]
        assert _cla_ips(upd) == ["10.1.0.1", "10.1.0.2"]
        with pytest.raises(queue.Empty):
            c.recv(0.3)  # no CDS, no LDS
        assert not server.wait_acked(v, 0.2)  # EDS counts for wait_acked
        c.send(_delta_req(ENDPOINT_TYPE, upd.nonce))
        assert server.wait_acked(v, TIMEOUT)

        # unsubscribed names are no longer pushed; the change still counts as in sync
        c.send(_delta_req(ENDPOINT_TYPE, unsub=(DB,)))
        assert _until(lambda: server.status()["streams"][0]["named"][ENDPOINT_TYPE] == 1)
        v = server.set_state(_mesh(web=("10.1.0.1", "10.1.0.2"), db=False))
        cds2 = c.recv()
        assert cds2.type_url == CLUSTER_TYPE and list(cds2.removed_resources) == [DB]
        c.send(_delta_req(CLUSTER_TYPE, cds2.nonce))
        lds2 = c.recv()
        assert lds2.type_url == LISTENER_TYPE
        c.send(_delta_req(LISTENER_TYPE, lds2.nonce))
        assert server.wait_acked(v, TIMEOUT)
    finally:
        c.close()


def test_sotw_eds_named_and_resubscription(server: XdsServer) -> None:
    server.set_state(_mesh())
    c = Client(server.socket_path, delta=False)
    try:
        for t in (CLUSTER_TYPE, LISTENER_TYPE):
            c.send(_sotw_req(t))
            r = c.recv()
            c.send(_sotw_req(t, r.version_info, r.nonce))
        c.send(_sotw_req(ENDPOINT_TYPE, names=(WEB,)))
        eds = c.recv()
        assert _cla_names(eds) == [WEB]
        # ACK carrying a bigger name set: answered with both
        c.send(_sotw_req(ENDPOINT_TYPE, eds.version_info, eds.nonce, names=(WEB, DB)))
        eds2 = c.recv()
        assert sorted(_cla_names(eds2)) == [DB, WEB]
        c.send(_sotw_req(ENDPOINT_TYPE, eds2.version_info, eds2.nonce, names=(WEB, DB)))

        v = server.set_state(_mesh(draining=True))
        upd = c.recv()
        assert upd.type_url == ENDPOINT_TYPE and sorted(_cla_names(upd)) == [DB, WEB]
        with pytest.raises(queue.Empty):
            c.recv(0.3)
        c.send(_sotw_req(ENDPOINT_TYPE, upd.version_info, upd.nonce, names=(WEB, DB)))
        assert server.wait_acked(v, TIMEOUT)
        # unchanged state: nothing re-sent, still acked
        v2 = server.set_state(_mesh(draining=True))
        with pytest.raises(queue.Empty):
            c.recv(0.3)
        assert server.wait_acked(v2, TIMEOUT)
    finally:
        c.close()


def test_no_services_needs_no_eds_ack(server: XdsServer) -> None:
    server.set_state(_mesh())
    v2 = server.set_state(_state("a"))
    c = Client(server.socket_path, delta=True)
    try:
        for t in (CLUSTER_TYPE, LISTENER_TYPE):
            c.send(_delta_req(t))
            r = c.recv()
            c.send(_delta_req(t, r.nonce))
        assert server.wait_acked(v2, TIMEOUT)  # EDS went empty: nothing to hold
    finally:
        c.close()


# ---- ALS -------------------------------------------------------------------------------

def _tcp_entry(dst: str, port: int, listener: str = "capture-a") -> Any:
    e = accesslog_pb2.TCPAccessLogEntry()
    cp = e.common_properties
    cp.downstream_local_address.socket_address.address = dst
    cp.downstream_local_address.socket_address.port_value = port
    cp.downstream_remote_address.socket_address.address = "10.1.0.1"
    if listener:
        cp.custom_tags["listener"] = listener
    return e


def test_parse_message_skips_non_ip() -> None:
    m = als_pb2.StreamAccessLogsMessage()
    m.tcp_logs.log_entry.extend([_tcp_entry("10.96.0.1", 80), _tcp_entry("", 0),
                                 _tcp_entry("fd00::1", 443, listener="")])
    got = [(e.listener_name, e.dst_ip, e.dst_port, e.src_ip) for e in parse_message(m)]
    assert got == [("capture-a", "10.96.0.1", 80, "10.1.0.1"), ("", "fd00::1", 443, "10.1.0.1")]


def test_als_stream_calls_back(tmp_path: Path) -> None:
    seen: queue.Queue[tuple[str, str, int]] = queue.Queue()
    s = XdsServer(str(tmp_path / "xds.sock"), on_access=lambda *a: seen.put(a))
    s.start()
    chan = grpc.insecure_channel("unix:" + s.socket_path)
    try:
        def msgs() -> Iterator[Any]:
            first = als_pb2.StreamAccessLogsMessage()
            first.identifier.log_name = "aether-passthrough"
            first.identifier.node.id = "n"
            first.tcp_logs.log_entry.append(_tcp_entry("10.96.0.1", 80))
            yield first
            nxt = als_pb2.StreamAccessLogsMessage()
            nxt.tcp_logs.log_entry.append(_tcp_entry("fd00:96::a", 8443, "capture-b"))
            yield nxt

        stub = als_pb2_grpc.AccessLogServiceStub(chan)
        stub.StreamAccessLogs(msgs(), timeout=TIMEOUT)
        assert seen.get(timeout=TIMEOUT) == ("capture-a", "10.96.0.1", 80)
        assert seen.get(timeout=TIMEOUT) == ("capture-b", "fd00:96::a", 8443)

        # another log name is not ours; a failing callback does not break the stream
        def boom(*_: Any) -> None:
            raise RuntimeError("x")

        s.set_access_callback(boom)

        def other() -> Iterator[Any]:
            m = als_pb2.StreamAccessLogsMessage()
            m.identifier.log_name = "someone-else"
            m.tcp_logs.log_entry.append(_tcp_entry("10.96.0.9", 80))
            yield m
            m2 = als_pb2.StreamAccessLogsMessage()
            m2.identifier.log_name = "aether-passthrough"
            m2.tcp_logs.log_entry.append(_tcp_entry("10.96.0.9", 81))
            yield m2

        stub.StreamAccessLogs(other(), timeout=TIMEOUT)
        assert s.als.entries == 3
    finally:
        chan.close()
        s.stop(0.1)



def _subscribed(server: XdsServer) -> Any:
    """A delta stream subscribed to CDS, EDS and LDS, as a connecting Envoy's."""
    from agent.envoy.resources import CLUSTER_TYPE, ENDPOINT_TYPE
    st = server._register(True, "test")
    for t in (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE):
        server._on_request(st, t, "", "node", None, {},
                           discovery_pb2.DeltaDiscoveryRequest(type_url=t))
    return st


def _two_namespaces() -> tuple[tuple[Any, ...], NodeXdsState]:
    """Pods in namespaces a and b, two Services: the moves' tests' starting state."""
    from agent.envoy.resources import PodListener
    from tests.test_envoy_resources import _view
    pods = (PodListener("p1", "/n/1", namespace="a"), PodListener("p2", "/n/2", namespace="b"))
    return pods, NodeXdsState(pods=pods, services=(_view(), _view("db", ips=("10.96.0.20",))))

def test_a_namespace_moving_to_its_own_listener_gets_the_listener_first(tmp_path: Path
                                                                         ) -> None:
    """A consumer route appearing in a namespace gives it an internal listener of its own;
    one ``set_state`` pushes that listener (LDS) before the namespace's cluster moves to it
    (CDS), so no connection meets a cluster reaching a listener Envoy does not have yet."""
    from dataclasses import replace

    from agent.envoy.resources import CLUSTER_TYPE
    from tests.test_envoy_resources import _consumer_gamma, _reaches

    server = XdsServer(str(tmp_path / "xds.sock"))
    st = _subscribed(server)
    pods, base = _two_namespaces()
    server.set_state(base)

    def drain() -> list[Any]:
        out = []
        while not st.out.empty():
            resp = st.out.get_nowait()
            if resp is not None:
                out.append(resp)
        return out

    drain()
    server.set_state(replace(base, gamma=_consumer_gamma("b")))
    sent = [(r.type_url, [x.name for x in r.resources]) for r in drain()]
    lds = [i for i, (t, names) in enumerate(sent) if t == LISTENER_TYPE and "mesh-b" in names]
    cds = [i for i, (t, names) in enumerate(sent) if t == CLUSTER_TYPE and "mesh-b" in names]
    assert len(lds) == 1 and len(cds) == 1 and lds[0] < cds[0], sent
    assert _reaches(server._snap.resources[CLUSTER_TYPE], "b") == "mesh-b"


def test_a_nacked_listener_keeps_the_namespace_where_it_was(tmp_path: Path) -> None:
    """Envoy refuses the LDS carrying a namespace's own listener: the publish does not
    move the namespace's cluster to it (it would reach a listener Envoy does not have)."""
    from dataclasses import replace

    from google.rpc import status_pb2

    from agent.envoy.resources import CLUSTER_TYPE
    from tests.test_envoy_resources import _consumer_gamma, _reaches

    server = XdsServer(str(tmp_path / "xds.sock"))
    st = _subscribed(server)
    stop = threading.Event()

    def envoy() -> None:
        """ACKs everything but an LDS carrying mesh-b, which it NACKs."""
        while not stop.is_set():
            try:
                resp = st.out.get(timeout=0.05)
            except queue.Empty:
                continue
            if resp is None:
                continue
            bad = resp.type_url == LISTENER_TYPE and any(
                r.name == "mesh-b" for r in resp.resources)
            err = status_pb2.Status(code=3, message="refused") if bad else None
            server._on_request(st, resp.type_url, resp.nonce, "", err, None,
                               discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url))

    worker = threading.Thread(target=envoy, daemon=True)
    worker.start()
    try:
        pods, base = _two_namespaces()
        server.set_state(base)
        time.sleep(0.3)  # the fake Envoy ACKs it
        server.set_state(replace(base, gamma=_consumer_gamma("b")))
        assert _reaches(server._snap.resources[CLUSTER_TYPE], "b") == "mesh"
        assert server.status()["last_nack"]["error_detail"] == "refused"
    finally:
        stop.set()
        worker.join(5)


def test_a_move_built_with_no_envoy_connected_waits_for_the_ack_of_its_listener(
        tmp_path: Path) -> None:
    """An agent starting (its adopted Envoy not reconnected yet) builds a namespace's move
    to a listener new in that build: the snapshot the Envoy will fetch carries the listener
    with the cluster still where it was, and the cluster moves once that Envoy has ACKed
    the listener."""
    from dataclasses import replace

    from agent.envoy.resources import CLUSTER_TYPE
    from tests.test_envoy_resources import _consumer_gamma, _reaches

    server = XdsServer(str(tmp_path / "xds.sock"))
    pods, base = _two_namespaces()
    server.set_state(base)
    server.set_state(replace(base, gamma=_consumer_gamma("b")))
    assert "mesh-b" in server._snap.resources[LISTENER_TYPE]
    assert _reaches(server._snap.resources[CLUSTER_TYPE], "b") == "mesh"
    version = server._snap.version
    st = _subscribed(server)
    assert server._snap.version == version  # nothing more until the listener is ACKed
    deadline = time.monotonic() + 5
    while _reaches(server._snap.resources[CLUSTER_TYPE], "b") != "mesh-b":
        assert time.monotonic() < deadline, "the cluster never moved after the ACK"
        try:
            resp = st.out.get(timeout=0.05)
        except queue.Empty:
            continue
        if resp is not None:  # ACK it, as Envoy would
            server._on_request(st, resp.type_url, resp.nonce, "", None, None,
                               discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url))
    assert server._snap.version > version


def test_a_deferred_move_is_dropped_when_a_later_state_came_first(tmp_path: Path) -> None:
    """The deferred move is built from the state it was deferred with: once another
    ``set_state`` has gone out, that older state must never be published again."""
    from dataclasses import replace

    from agent.envoy.resources import PodListener
    from tests.test_envoy_resources import _consumer_gamma

    server = XdsServer(str(tmp_path / "xds.sock"))
    pods, base = _two_namespaces()
    server.set_state(base)
    server.set_state(replace(base, gamma=_consumer_gamma("b")))
    deferred = server._deferred
    assert deferred is not None
    newer = replace(base, gamma=_consumer_gamma("b"),
                    pods=(*pods, PodListener("p3", "/n/3", namespace="a")))
    server.set_state(newer)
    version = server._snap.version
    server._finish_move(deferred)  # what a late ACK would have started
    assert server._snap.version == version
    assert PodListener("p3", "/n/3", namespace="a").listener_name in \
        server._snap.resources[LISTENER_TYPE]


def test_a_held_server_sends_nothing_until_released(tmp_path: Path) -> None:
    """An adopted Envoy reconnecting to a restarted agent gets nothing while the agent is
    still loading (``hold``): what it has keeps serving. At ``release`` it gets the state
    of that moment, in xDS order, and a move built meanwhile waits for that listener's
    ACK."""
    from dataclasses import replace

    from agent.envoy.resources import CLUSTER_TYPE, ENDPOINT_TYPE
    from tests.test_envoy_resources import _consumer_gamma, _reaches

    server = XdsServer(str(tmp_path / "xds.sock"))
    server.hold()
    st = _subscribed(server)
    pods, base = _two_namespaces()
    v1 = server.set_state(base)
    server.set_state(replace(base, gamma=_consumer_gamma("b")))
    assert st.out.empty()
    assert not server.wait_acked(v1, 0.05)
    assert _reaches(server._snap.resources[CLUSTER_TYPE], "b") == "mesh"  # deferred
    server.release()
    sent = []
    while not st.out.empty():
        resp = st.out.get_nowait()
        sent.append(resp.type_url)
    assert sent == [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE]
    server.release()  # a second release sends nothing more
    assert st.out.empty()
