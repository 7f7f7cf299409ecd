"""The pod DNS in the capture lifecycle (agent.dns.sink): served before the pod's listener
and gone after it, an ADD failed when it cannot be served, a restored pod retried in the
background, and the proxy sink's attributes and stop reached through it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent.capture.policy import CapturePolicy
from agent.cni.state import CapturedPod
from agent.common.ids import ContainerId
from agent.dns import sink as dns_sink
from agent.dns.process import DnsUnavailable
from agent.dns.sink import DnsSink


class FakeDns:
    def __init__(self, fail: int = 0) -> None:
        self.log: list[str] = []
        self.fail = fail
        self.served: set[str] = set()
        self.lingered: bool | None = None

    def serve(self, cid: str, key: str, netns: str) -> None:
        if self.fail:
            self.fail -= 1
            raise DnsUnavailable("port held")
        self.log.append(f"serve {cid}")
        self.served.add(cid)

    def unserve(self, cid: str) -> None:
        self.log.append(f"unserve {cid}")
        self.served.discard(cid)

    def serving(self, cid: str) -> bool:
        return cid in self.served

    def stop(self, linger: bool = False) -> None:
        self.lingered = linger


class FakeProxy:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail, self.authz_for = log, fail, None

    def add_pod(self, pod: CapturedPod) -> None:
        if self.fail:
            raise TimeoutError("no ACK")
        self.log.append(f"listener {pod.container_id}")

    def remove_pod(self, pod: CapturedPod) -> None:
        self.log.append(f"unlisten {pod.container_id}")

    def stop(self, keep_envoy: bool = False) -> None:
        self.log.append(f"stop keep={keep_envoy}")


def _pod(cid: str = "c1", dns: bool = True) -> CapturedPod:
    policy = CapturePolicy(redirect_all=True, capture_port=15001, mesh_port=18081, mark=0xAE,
                           mark_mask=0xFF, dns_capture=dns)
    return CapturedPod(ContainerId(cid), "uid", "app", "p", "default", "/run/netns/x",
                       "/run/netns/x", "eth0", ["10.0.0.5"], policy, "fp", "managed")


def test_dns_is_served_before_the_listener_and_removed_after_it() -> None:
    dns = FakeDns()
    sink = DnsSink(FakeProxy(dns.log), dns)  # type: ignore[arg-type]
    sink.add_pod(_pod())
    sink.remove_pod(_pod())
    assert dns.log == ["serve c1", "listener c1", "unlisten c1", "unserve c1"]


def test_a_pod_opted_out_gets_no_dns() -> None:
    dns = FakeDns()
    DnsSink(FakeProxy(dns.log), dns).add_pod(_pod(dns=False))  # type: ignore[arg-type]
    assert dns.log == ["listener c1"]


def test_dns_that_cannot_be_served_fails_the_add_before_the_listener() -> None:
    dns = FakeDns(fail=1)
    with pytest.raises(DnsUnavailable):
        DnsSink(FakeProxy(dns.log), dns).add_pod(_pod())  # type: ignore[arg-type]
    assert dns.log == []


def test_a_listener_that_fails_takes_the_dns_with_it() -> None:
    dns = FakeDns()
    with pytest.raises(TimeoutError):
        DnsSink(FakeProxy(dns.log, fail=True), dns).add_pod(_pod())  # type: ignore[arg-type]
    assert dns.log == ["serve c1", "unserve c1"] and not dns.served


def test_a_restored_pod_whose_port_is_held_is_served_once_it_is_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dns_sink, "RESTORE_RETRY_S", 0.01)
    dns = FakeDns(fail=3)
    sink = DnsSink(FakeProxy(dns.log), dns)  # type: ignore[arg-type]
    sink.restore_pod(_pod())  # does not raise: the previous agent still answers the pod
    deadline = time.monotonic() + 5
    while "serve c1" not in dns.log:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert dns.log[0] == "listener c1"


def test_the_proxy_sinks_attributes_and_stop_are_reached_through() -> None:
    dns = FakeDns()
    proxy = FakeProxy(dns.log)
    sink: Any = DnsSink(proxy, dns)  # type: ignore[arg-type]
    sink.authz_for = "callback"
    assert proxy.authz_for == "callback" and sink.fail is False
    sink.stop(keep_envoy=True)
    assert dns.lingered is True and dns.log[-1] == "stop keep=True"
    sink.stop()
    assert dns.lingered is False


def test_a_live_policy_change_serves_dns_before_and_drops_it_after_the_rules() -> None:
    from dataclasses import replace
    dns = FakeDns()
    sink = DnsSink(FakeProxy(dns.log), dns)  # type: ignore[arg-type]
    pod = _pod(dns=False)
    on = replace(pod.policy, dns_capture=True)
    sink.policy_changing(pod, on)  # the annotation now captures DNS: served first
    assert dns.log == ["serve c1"]
    sink.policy_changed(pod, on)
    assert dns.log == ["serve c1"]
    sink.policy_changing(pod, pod.policy)  # and back: nothing before the rules ...
    assert dns.log == ["serve c1"]
    sink.policy_changed(pod, pod.policy)  # ... and the DNS gone after them
    assert dns.log == ["serve c1", "unserve c1"]
