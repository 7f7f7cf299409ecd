"""`aether-agent status` as a person reads it: Envoy's ACKed versions by resource kind."""

from __future__ import annotations

from agent.ops.status_view import acked_versions, render

T = "type.googleapis.com/envoy.config"


def test_acked_versions_read_by_kind_in_a_fixed_order() -> None:
    acked = {f"{T}.listener.v3.Listener": "7", "type.googleapis.com/envoy.extensions."
             "transport_sockets.tls.v3.Secret": "7", f"{T}.cluster.v3.Cluster": "7",
             f"{T}.endpoint.v3.ClusterLoadAssignment": "6"}
    assert acked_versions(acked) == "clusters v7, listeners v7, endpoints v6, secrets v7"
    assert acked_versions({}) == "none yet"
    assert acked_versions(None) == "none yet"


def test_status_line_carries_no_python_dict() -> None:
    text = render({"envoy": {"pid": 1, "ready": True, "restarts": 0, "rss_bytes": 0,
                             "acked_version": {f"{T}.cluster.v3.Cluster": "3"}}})
    assert "acked: clusters v3 · nacks 0" in text
    assert "{" not in text
