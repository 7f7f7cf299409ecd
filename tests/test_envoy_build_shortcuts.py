"""The full build's shortcuts (issue #43) change nothing it builds: the IPv4 fast path of
``_cidr`` agrees with ``ipaddress`` and a Service cluster copied from its template is the
cluster built field by field, never sharing state with another copy."""

from __future__ import annotations

import ipaddress

import pytest

from agent.envoy.clusters import build_service_cluster
from agent.envoy.service_chains import _cidr
from agent.scope.model import ServiceView
from agent.scope.services import ServicePort, TrafficPolicy

ADDRESSES = ["10.0.0.1", "0.0.0.0", "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3.04",
             "1.2.3", "1.2.3.4.5", "a.b.c.d", " 1.2.3.4", "1.2.3.4 ", "\u0661.2.3.4", "1..2.3",
             "1.2.3.", "", "10.0.0.1/32", "+1.2.3.4", "::1", "fd00:96::a", "FD00::A",
             "::ffff:10.0.0.1", "fe80::1%eth0"]


@pytest.mark.parametrize("ip", ADDRESSES)
def test_cidr_agrees_with_ipaddress(ip: str) -> None:
    try:
        addr = ipaddress.ip_address(ip)
        want: tuple[str, int] | None = (str(addr), addr.max_prefixlen)
    except ValueError:
        want = None
    got = _cidr(ip)
    assert (None if got is None else (got.address_prefix, got.prefix_len.value)) == want


def _view(name: str, app: str | None = "http", affinity: bool = False) -> ServiceView:
    return ServiceView(key=f"ns/{name}", namespace="ns", name=name, cluster_ips=("10.96.0.1",),
                       ports=(ServicePort(80, "http", app_protocol=app),), names=(),
                       traffic=TrafficPolicy(client_ip_affinity=affinity))


def test_template_copies_are_distinct_and_carry_their_own_names() -> None:
    a = build_service_cluster(_view("a"), 80, 1.0, tunnel=True)
    b = build_service_cluster(_view("b"), 80, 1.0, tunnel=True)
    assert (a.name, a.eds_cluster_config.service_name) == ("svc|ns|a|80", "svc|ns|a|80")
    assert (b.name, b.eds_cluster_config.service_name) == ("svc|ns|b|80", "svc|ns|b|80")
    a.ClearField("outlier_detection")  # what the headless path does to its copy
    assert b.HasField("outlier_detection")
    assert build_service_cluster(_view("b"), 80, 1.0, tunnel=True) == b
    # what the template is keyed by still tells clusters apart
    assert build_service_cluster(_view("b", affinity=True), 80, 1.0, tunnel=True).lb_policy \
        != b.lb_policy
    assert build_service_cluster(_view("b", app="grpc"), 80, 1.0, tunnel=True) != b
    assert build_service_cluster(_view("b"), 80, 2.0, tunnel=True) != b
    assert build_service_cluster(_view("b"), 80, 1.0, tunnel=False) != b
