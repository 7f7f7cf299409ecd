"""Metrics exposition and the probe endpoints, scraped over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.ops.metrics import LIVE, Metrics, MetricsServer


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def served():
    state = {"live": True, "ready": (False, "envoy not ready")}
    m = Metrics()
    srv = MetricsServer(m, "127.0.0.1", 0, live=lambda: state["live"],
                        ready=lambda: state["ready"]).start()
    try:
        yield m, srv, state
    finally:
        srv.stop()


def test_port_zero_binds_and_reports_the_port(served):
    _, srv, _ = served
    assert srv.port > 0
    assert _get(srv.port, "/healthz") == (200, "ok\n")


def test_scrape_shows_cni_observations(served):
    m, srv, _ = served
    m.observe_cni("ADD", 0.02, "ok")
    m.observe_cni("ADD", 0.5, "ok")
    m.observe_cni("ADD", 0.01, "skipped")
    m.observe_cni("DEL", 0.003, "ok")
    m.observe_cni("CHECK", 0.004, "failed")
    m.observe_cni(None, 0.0, "failed")  # a malformed request
    status, body = _get(srv.port, "/metrics")
    assert status == 200
    s = _samples(body)
    req = "aether_cni_requests_total"
    assert s[(req, (("command", "ADD"), ("outcome", "ok")))] == 2
    assert s[(req, (("command", "ADD"), ("outcome", "skipped")))] == 1
    assert s[(req, (("command", "ADD"), ("outcome", "failed")))] == 0  # pre-created series
    assert s[(req, (("command", "DEL"), ("outcome", "ok")))] == 1
    assert s[(req, (("command", "CHECK"), ("outcome", "failed")))] == 1
    assert s[(req, (("command", "invalid"), ("outcome", "failed")))] == 1
    dur = "aether_cni_request_duration_seconds"
    assert s[(dur + "_count", (("command", "ADD"),))] == 3
    assert s[(dur + "_sum", (("command", "ADD"),))] == pytest.approx(0.53)
    assert s[(dur + "_bucket", (("command", "ADD"), ("le", "0.025")))] == 2
    assert s[(dur + "_count", (("command", "DEL"),))] == 1


def test_bad_outcome_is_a_programming_error():
    with pytest.raises(ValueError, match="outcome"):
        Metrics().observe_cni("ADD", 0.1, "maybe")


def test_live_sources_are_read_at_scrape_time(served):
    m, srv, _ = served
    restarts = [0]
    m.set_sources(envoy_restarts=lambda: restarts[0], envoy_ready=lambda: 1, pods_captured=lambda: 3,
                  xds_pushes=lambda: 7, xds_acks=lambda: 6, xds_nacks=lambda: 1,
                  dependency_set_size=lambda: 12, annotation_errors=lambda: 2, cni_repairs=lambda: 4)
    m.observe_xds_push(0.02)
    s = _samples(_get(srv.port, "/metrics")[1])
    assert s[("aether_envoy_restarts_total", ())] == 0
    assert s[("aether_envoy_ready", ())] == 1
    assert s[("aether_pods_captured", ())] == 3
    assert s[("aether_xds_pushes_total", ())] == 7
    assert s[("aether_xds_acks_total", ())] == 6
    assert s[("aether_xds_nacks_total", ())] == 1
    assert s[("aether_dependency_set_size", ())] == 12
    assert s[("aether_annotation_errors_total", ())] == 2
    assert s[("aether_cni_repairs_total", ())] == 4
    assert s[("aether_xds_push_duration_seconds_count", ())] == 1
    restarts[0] = 5  # the supervisor counted: no push needed
    s = _samples(_get(srv.port, "/metrics")[1])
    assert s[("aether_envoy_restarts_total", ())] == 5


def test_failing_or_dropped_source_is_left_out_not_fatal(served):
    m, srv, _ = served

    def boom() -> float:
        raise RuntimeError("supervisor gone")

    m.set_sources(envoy_restarts=boom, pods_captured=lambda: 1)
    status, body = _get(srv.port, "/metrics")
    assert status == 200
    s = _samples(body)
    assert ("aether_envoy_restarts_total", ()) not in s
    assert s[("aether_pods_captured", ())] == 1
    m.set_sources(pods_captured=None)
    assert ("aether_pods_captured", ()) not in _samples(_get(srv.port, "/metrics")[1])


def test_unknown_source_name_is_rejected():
    with pytest.raises(ValueError, match="envoy_restart"):
        Metrics().set_sources(envoy_restart=lambda: 1)
    assert set(LIVE) >= {"envoy_restarts", "xds_acks", "cni_repairs"}


def test_registries_are_independent():
    a, b = Metrics(), Metrics()
    a.observe_cni("ADD", 0.1, "ok")
    sa, sb = _samples(a.render().decode()), _samples(b.render().decode())
    key = ("aether_cni_requests_total", (("command", "ADD"), ("outcome", "ok")))
    assert sa[key] == 1
    assert sb[key] == 0


def test_readyz_follows_the_callable(served):
    _, srv, state = served
    assert _get(srv.port, "/readyz") == (503, "envoy not ready\n")
    state["ready"] = (True, "")
    assert _get(srv.port, "/readyz") == (200, "ready\n")
    state["ready"] = (False, "CNI plugin not installed in /etc/cni/net.d")
    assert _get(srv.port, "/readyz") == (503, "CNI plugin not installed in /etc/cni/net.d\n")


def test_healthz_follows_the_callable_and_errors_are_503(served):
    _, srv, state = served
    state["live"] = False
    assert _get(srv.port, "/healthz")[0] == 503
    state["live"] = True
    assert _get(srv.port, "/healthz")[0] == 200
    state["ready"] = None  # not a tuple: the check itself is broken
    code, body = _get(srv.port, "/readyz")
    assert code == 503 and "readiness check failed" in body
    assert _get(srv.port, "/nope")[0] == 404


def test_stop_releases_the_port():
    m = Metrics()
    srv = MetricsServer(m, "127.0.0.1", 0, live=lambda: True, ready=lambda: (True, "")).start()
    port = srv.port
    srv.stop()
    again = MetricsServer(m, "127.0.0.1", port, live=lambda: True, ready=lambda: (True, "")).start()
    try:
        assert _get(port, "/healthz")[0] == 200
    finally:
        again.stop()


def test_svid_expiry_is_the_seconds_left_and_minus_one_when_none_is_held(served):
    """aether_svid_expiry_seconds from the identity manager: the seconds left of a held SVID,
    -1 for an identity with local pods whose SVID could not be issued (its pods fail closed)."""
    from agent.identity.manager import IdentityError, IdentityManager
    from agent.identity.svid import Svid

    class Provider:
        name = "test"

        def issue(self, sid: str, now: float) -> Svid:
            if "/sa/down" in sid:
                raise IdentityError("provider down")
            return Svid(sid, "CERT", "KEY", now, now + 600.0, now)

        def bundle_pem(self) -> str:
            return "BUNDLE"

    now = [1000.0]
    ident = IdentityManager(Provider(), "cluster.local", clock=lambda: now[0])
    ident.attach("app/web", "app/web-1")
    ident.attach("app/down", "app/down-1")
    m, srv, _ = served
    m.identity_source = ident.status
    now[0] += 100
    s = _samples(_get(srv.port, "/metrics")[1])
    assert s[("aether_svid_expiry_seconds", (("identity", "app/web"),))] == 500
    assert s[("aether_svid_expiry_seconds", (("identity", "app/down"),))] == -1
    assert s[("aether_svid_rotations_total", ())] == 0
