"""Bootstrap shape, plus proof that Envoy itself accepts bootstrap and resources."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from envoy.config.cluster.v3 import cluster_pb2

from agent.envoy.bootstrap import build_bootstrap, ensure_private_dir, write_bootstrap
from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    PodListener,
)
from agent.envoy.resources import build_resources as build
from agent.envoy.supervisor import find_envoy_binary
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

MESH_VIEWS = (
    ServiceView(key="mesh/web", namespace="mesh", name="web",
                cluster_ips=("10.96.77.10", "fd00:96::a"),
                ports=(ServicePort(80, "http", target_port=8080), ServicePort(443, "https")),
                names=("web.mesh.svc.cluster.local",),
                endpoints={80: (Endpoint("10.1.0.5", 8080, "mesh/sa", True, False, "spiffe://x"),
                                Endpoint("fd00:1::5", 8080, "mesh/sa", True, True))}),
    ServiceView(key="mesh/db", namespace="mesh", name="db", cluster_ips=("10.96.77.11",),
                ports=(ServicePort(5432),), names=()),
)


def test_shape_delta_default() -> None:
    b = build_bootstrap("node-a", "/run/x/xds.sock", 15000)
    assert b["node"] == {"id": "node-a", "cluster": "aether"}
    ads = b["dynamic_resources"]["ads_config"]
    assert ads["api_type"] == "DELTA_GRPC"
    assert ads["transport_api_version"] == "V3"
    assert ads["set_node_on_first_message_only"] is True
    grpc = ads["grpc_services"][0]["envoy_grpc"]
    assert grpc["cluster_name"] == "xds"
    assert grpc["retry_policy"]["retry_back_off"]["max_interval"] == "1s"
    for k in ("lds_config", "cds_config"):
        assert b["dynamic_resources"][k]["ads"] == {}
    (xds,) = b["static_resources"]["clusters"]
    ep = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert ep["address"] == {"pipe": {"path": "/run/x/xds.sock"}}
    opts = xds["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    assert b["bootstrap_extensions"] == [{
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap."
                                  "internal_listener.v3.InternalListener"}}]
    assert b["admin"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 15000}}
    (mon,) = b["overload_manager"]["resource_monitors"]
    assert mon["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert mon["typed_config"]["max_active_downstream_connections"] == 50000


def test_sotw_and_unix_admin() -> None:
    b = build_bootstrap("n", "/x.sock", "/run/admin.sock", delta=False,
                        set_node_on_first_message_only=False)
    assert b["dynamic_resources"]["ads_config"]["api_type"] == "GRPC"
    assert b["dynamic_resources"]["ads_config"]["set_node_on_first_message_only"] is False
    # root only: Envoy chmods the socket to Pipe.mode right after binding it
    assert b["admin"]["address"] == {"pipe": {"path": "/run/admin.sock", "mode": 0o600}}
    b = build_bootstrap("n", "/x.sock", "/run/admin.sock", admin_mode=0o660)
    assert b["admin"]["address"]["pipe"]["mode"] == 0o660


def test_private_dir(tmp_path: Path) -> None:
    d = tmp_path / "envoy"
    ensure_private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o755)  # a directory left open by an older agent is closed again
    ensure_private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        ensure_private_dir(str(tmp_path / "file"))
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(PermissionError):
        ensure_private_dir(str(tmp_path / "link"))


def test_write_is_json(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "b.json"
    b = build_bootstrap("n", "/x.sock", "/run/admin.sock")
    write_bootstrap(str(p), b)
    assert json.loads(p.read_text()) == b
    assert [f.name for f in p.parent.iterdir()] == ["b.json"]


def _envoy() -> str:
    return find_envoy_binary()  # a dependency: a missing binary fails the test, never skips


@pytest.mark.parametrize("delta", [True, False])
def test_envoy_validates_bootstrap_with_built_resources(tmp_path: Path, delta: bool) -> None:
    """``envoy --mode validate`` accepts bootstrap (internal listener extension) + pod
    listeners + the internal namespace listener (Service chains, gRPC access log) + its
    internal cluster + passthrough and EDS-over-ADS Service clusters."""
    res = build(NodeXdsState(pods=(PodListener("a", "/var/run/netns/a"),
                                   PodListener("b", "/var/run/netns/b", ipv6=False)),
                             services=MESH_VIEWS))
    assert len(res[LISTENER_TYPE]["mesh"].message().filter_chains) == 3
    listeners = [getattr(lis, "message", lambda lis=lis: lis)()
                 for lis in res[LISTENER_TYPE].values()]
    b = build_bootstrap("n", str(tmp_path / "xds.sock"), str(tmp_path / "admin.sock"), delta=delta,
                        static_listeners=listeners,
                        static_clusters=[getattr(c, "message", lambda c=c: c)()
                                         for c in res[CLUSTER_TYPE].values()])
    p = tmp_path / "b.json"
    write_bootstrap(str(p), b)
    out = subprocess.run([_envoy(), "--mode", "validate", "-c", str(p), "-l", "warn"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout + out.stderr


def test_find_binary_on_path() -> None:
    if shutil.which("envoy"):
        assert find_envoy_binary() == shutil.which("envoy")


def test_envoy_validates_endpoints_as_static_load_assignment(tmp_path: Path) -> None:
    """The EDS payload itself: each ClusterLoadAssignment (health, metadata) embedded as
    the ``load_assignment`` of a STATIC cluster, which Envoy validates like EDS input."""
    res = build(NodeXdsState(pods=(), services=MESH_VIEWS))
    statics = []
    for name, cla in res[ENDPOINT_TYPE].items():
        c = cluster_pb2.Cluster()
        c.CopyFrom(res[CLUSTER_TYPE][name].message())
        c.ClearField("eds_cluster_config")
        c.type = cluster_pb2.Cluster.STATIC
        c.load_assignment.CopyFrom(cla.message())
        statics.append(c)
    b = build_bootstrap("n", str(tmp_path / "xds.sock"), 15000, static_clusters=statics,
                        dynamic=False)
    p = tmp_path / "b.json"
    write_bootstrap(str(p), b)
    out = subprocess.run([_envoy(), "--mode", "validate", "-c", str(p), "-l", "warn"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
