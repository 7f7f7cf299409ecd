"""Live enrollment and release on a real node (bridge + aether-cni + agent + Envoy): a running
pod is captured within 5 s of its namespace gaining `aether.io/managed=true` (its outbound TCP
then needs the proxy), released within 5 s of the label going away (it reaches its destination
with the proxy frozen), and a changed exclusion is applied in place."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from agent.cni.handler import RELEASE_GRACE_S
from agent.netns import nft
from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Pod
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode
from integration.taps import carried

pytestmark = [pytest.mark.integration]

NAMESPACES = "namespaces.yaml"


def _namespaces(enode: EnvoyNode, plain_managed: bool) -> None:
    plain: dict[str, object] = {"name": "plain"}
    if plain_managed:
        plain["labels"] = {"aether.io/managed": "true"}
    enode.agent.write(NAMESPACES, [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "app", "labels": {"aether.io/managed": "true"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": plain},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}},
    ])


def _within(seconds: float, what: str, cond: Callable[[], bool]) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if cond():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds:.0f} s: {what}")


def _captured(enode: EnvoyNode, pod: Pod) -> bool:
    for p in enode.agent.status()["pods"]:
        if p["pod"] == f"{pod.namespace}/{pod.name}" and p.get("listener") == "live":
            return True
    return False


def _released(enode: EnvoyNode, pod: Pod) -> bool:
    """Nothing redirects the pod's connections any more (its table is gone, or is the empty
    one a release keeps for a few seconds so proxied connections can close cleanly)."""
    keys = {p["pod"] for p in enode.agent.status()["pods"]}
    table = nft.list_table_text(pod.netns)
    return f"{pod.namespace}/{pod.name}" not in keys and (table is None or "redirect" not in table)


def _table_gone(pod: Pod) -> bool:
    return nft.list_table_text(pod.netns) is None


@contextmanager
def _frozen(enode: EnvoyNode) -> Iterator[None]:
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_running_pod_is_captured_and_released_as_its_namespace_label_changes(
        enode: EnvoyNode) -> None:
    pod = enode.pod("plain")
    enode.add(pod)
    assert nft.list_table_text(pod.netns) is None  # unmanaged: ADD left it alone
    srv, port = host_server(tag=b"direct")
    try:
        with _frozen(enode):  # not captured: the proxy is not on its path
            assert dial(pod.netns, GW4, port) == "direct"

        _namespaces(enode, plain_managed=True)
        took = _within(5, "captured after the label appeared", lambda: _captured(enode, pod))
        assert nft.list_table_text(pod.netns) is not None
        before = carried(enode, pod)
        assert dial(pod.netns, GW4, port) == "direct"
        assert carried(enode, pod) == before + 1  # through the proxy now
        with _frozen(enode):  # and only through it
            assert dial(pod.netns, GW4, port, timeout=1.5).startswith("error:")
        st = enode.agent.status()
        assert st["counters"]["enrolled"] == 1, st["counters"]

        _namespaces(enode, plain_managed=False)
        took_release = _within(5, "released after the label went away",
                               lambda: _released(enode, pod))
        with _frozen(enode):  # released: reaches its destination with the proxy frozen
            assert dial(pod.netns, GW4, port) == "direct"
        enode.listener_withdrawn(pod.container_id)
        _within(RELEASE_GRACE_S + 2, "the emptied table dropped", lambda: _table_gone(pod))

        _namespaces(enode, plain_managed=True)  # and back again: remembered when released
        _within(5, "captured again", lambda: _captured(enode, pod))
        with _frozen(enode):
            assert dial(pod.netns, GW4, port, timeout=1.5).startswith("error:")
        print(f"capture {took:.2f} s, release {took_release:.2f} s")
    finally:
        srv.close()
    # DEL of a live-enrolled pod cleans up like any other
    enode.kubelet.delete(pod)
    enode.pods.remove(pod)
    assert enode.agent.status()["pods"] == []


def test_a_changed_exclusion_is_applied_in_place(enode: EnvoyNode) -> None:
    srv, port = host_server(tag=b"direct")
    pod = enode.pod("app")
    try:
        enode.add(pod)
        with _frozen(enode):
            assert dial(pod.netns, GW4, port, timeout=1.5).startswith("error:")
        enode.agent.add_pod(pod, annotations={
            "capture.aether.io/exclude-outbound-ports": str(port)})

        def excluded() -> bool:
            text = nft.list_table_text(pod.netns) or ""
            return str(port) in text

        _within(5, "exclusion applied", excluded)
        with _frozen(enode):  # the excluded port goes direct, the pod stays captured
            assert dial(pod.netns, GW4, port) == "direct"
        assert _captured(enode, pod)
        assert enode.agent.status()["counters"]["reapplied"] == 1
    finally:
        srv.close()


def test_connections_open_at_enrollment_finish_directly(enode: EnvoyNode) -> None:
    """Rules act on new connections (nat decides at a connection's first packet): one open
    when the pod is enrolled keeps its direct path; the next one goes through the proxy."""
    pod = enode.pod("plain")
    enode.add(pod)
    echo = socket.create_server(("0.0.0.0", 0))
    port = echo.getsockname()[1]
    conns: list[socket.socket] = []

    def connect() -> socket.socket:
        s = socket.socket()
        s.settimeout(3)
        s.connect((GW4, port))
        return s

    try:
        client = run_in_netns(pod.netns, connect)
        server_side, _ = echo.accept()
        server_side.settimeout(3)
        conns += [client, server_side]
        _namespaces(enode, plain_managed=True)
        _within(5, "captured", lambda: _captured(enode, pod))
        client.sendall(b"still-direct")
        assert server_side.recv(64) == b"still-direct"
        server_side.sendall(b"ok")
        assert client.recv(64) == b"ok"
        with _frozen(enode):  # a new connection needs the proxy: none reaches the server
            try:
                conns.append(run_in_netns(pod.netns, connect))
            except OSError:
                pass  # refused or timed out: equally not direct
            echo.settimeout(1.0)
            with pytest.raises(TimeoutError):
                echo.accept()
    finally:
        for c in conns:
            c.close()
        echo.close()


def test_a_pod_older_than_aether_is_found_by_its_ip_and_released_by_its_del(
        enode: EnvoyNode) -> None:
    """A pod started without aether-cni in the chain: no ADD of ours ever saw it. Once its
    Pod (with status.podIPs) says it is to be captured, the agent finds its netns by IP."""
    pod = enode.kubelet.new_pod("app", "older")
    plugins = enode.kubelet.conflist["plugins"]
    enode.kubelet.conflist["plugins"] = [p for p in plugins if p["type"] != "aether-cni"]
    try:
        enode.add(pod)  # the reference plugins only
    finally:
        enode.kubelet.conflist["plugins"] = plugins
    enode.pods.append(pod)
    assert nft.list_table_text(pod.netns) is None
    enode.agent.write(f"pod-app-{pod.name}.yaml", [{
        "apiVersion": "v1", "kind": "Pod",
        # no ADD has told the agent the netconf's redirect-all default yet: say it here
        "metadata": {"name": pod.name, "namespace": "app", "uid": pod.uid,
                     "annotations": {"capture.aether.io/redirect-all": "true"}},
        "spec": {"nodeName": "test-node"},
        "status": {"phase": "Running", "podIPs": [{"ip": pod.ip(4)}, {"ip": pod.ip(6)}]},
    }])
    _within(5, "found by IP and captured", lambda: _captured(enode, pod))
    srv, port = host_server(tag=b"direct")
    try:
        with _frozen(enode):
            assert dial(pod.netns, GW4, port, timeout=1.5).startswith("error:")
    finally:
        srv.close()
    assert enode.agent.status()["live_enrollment"]["discovered"] == 1
    # kubelet's DEL carries the real container id: it releases the pod all the same
    enode.kubelet.delete(pod, remove_netns=False)
    assert enode.agent.status()["pods"] == []
    assert nft.list_table_text(pod.netns) is None


def _through_the_proxy(enode: EnvoyNode, pod: Pod, before: int) -> None:
    """The capture listener counted the connection. On failure, say what the pod's capture
    looked like then (its table, its status, the agent's lines about it): the count was once
    found unchanged in CI and never since, so the next occurrence must explain itself."""
    try:
        _within(2, "counted by the capture listener", lambda: carried(enode, pod) == before + 1)
    except AssertionError:
        lines = [ln for ln in enode.agent.logs().splitlines()
                 if pod.name in ln or "enroll" in ln or "release" in ln][-30:]
        status = [p for p in enode.agent.status()["pods"] if pod.name in p["pod"]]
        raise AssertionError(
            f"carried {carried(enode, pod)} (before {before}); listeners {enode.listeners()}; "
            f"status {status}; table {nft.list_table_text(pod.netns)!r}; agent log:\n"
            + "\n".join(lines)) from None


def test_connections_open_through_the_proxy_at_release_are_closed_and_the_next_goes_direct(
        enode: EnvoyNode) -> None:
    """At release the table goes first (new connections go direct at once), then the pod's
    listener: Envoy closes the connections it was carrying for it (their NAT binding points
    at a listener that is gone), so clients see them end and reconnect directly."""
    pod = enode.pod("plain")
    enode.add(pod)
    _namespaces(enode, plain_managed=True)
    _within(5, "captured", lambda: _captured(enode, pod))
    echo = socket.create_server(("0.0.0.0", 0))
    echo.settimeout(5)
    port = echo.getsockname()[1]

    def connect() -> socket.socket:
        s = socket.socket()
        s.settimeout(3)
        s.connect((GW4, port))
        return s

    before = carried(enode, pod)
    client = run_in_netns(pod.netns, connect)
    server_side, _ = echo.accept()
    server_side.settimeout(10)
    conns = [client, server_side]
    try:
        _through_the_proxy(enode, pod, before)
        _namespaces(enode, plain_managed=False)
        changed_at = time.monotonic()
        assert server_side.recv(64) == b""  # Envoy closed its upstream side
        client.settimeout(10)
        try:
            assert client.recv(64) == b""  # and its downstream side
        except ConnectionResetError:
            pass
        ended_after = time.monotonic() - changed_at
        assert ended_after < 5, ended_after
        _within(5, "released", lambda: _released(enode, pod))
        _within(RELEASE_GRACE_S + 2, "the emptied table dropped", lambda: _table_gone(pod))
        with _frozen(enode):  # the next connection goes direct
            conns.append(run_in_netns(pod.netns, connect))
            conns.append(echo.accept()[0])
        print(f"proxied connection ended {ended_after:.2f} s after the label went away")
    finally:
        for c in conns:
            c.close()
        echo.close()
