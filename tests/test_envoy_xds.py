"""xDS server protocol tests with a real gRPC client over a unix socket."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.listener.v3 import listener_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from agent.envoy.resources import CLUSTER_TYPE, LISTENER_TYPE, NodeXdsState, PodListener
from agent.envoy.xds import XdsServer

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


def _sotw_req(t: str, version: str = "", nonce: str = "", err: str | None = None) -> Any:
    r = discovery_pb2.DiscoveryRequest(type_url=t, version_info=version, response_nonce=nonce)
    r.node.id = "test-node"
    if err is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=err))
    return r


def _delta_req(t: str, nonce: str = "", err: str | None = None,
               initial: dict[str, str] | None = None) -> Any:
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=t, response_nonce=nonce,
                                            initial_resource_versions=initial or {})
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
        assert _names(lds) == ["capture-a"] and lds.version_info == v1
        assert not server.wait_acked(v1, 0.2)  # LDS not yet ACKed
        c.send(_sotw_req(LISTENER_TYPE, lds.version_info, lds.nonce))
        assert server.wait_acked(v1, TIMEOUT)

        # A change pushes the full LDS set (unchanged CDS is not re-sent).
        v2 = server.set_state(_state("a", "b"))
        lds2 = c.recv()
        assert lds2.type_url == LISTENER_TYPE
        assert _names(lds2) == ["capture-a", "capture-b"] and lds2.nonce != lds.nonce
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
        assert [r.name for r in cds.resources] == ["passthrough"]
        c.send(_delta_req(CLUSTER_TYPE, cds.nonce))
        c.send(_delta_req(LISTENER_TYPE))
        lds = c.recv()
        assert [r.name for r in lds.resources] == ["capture-a", "capture-b"]
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
        init = {"capture-a": have["capture-a"], "capture-b": have["capture-b"]}
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
