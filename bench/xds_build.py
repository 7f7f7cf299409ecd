"""xDS build + publish benchmark at mesh scale (issue 9): no Envoy needed.

    python -m bench.xds_build [--services 1000,10000] [--pods 110] [--namespaces 5]
                              [--json OUT] [--quick] [--envoy]

Per Service count N: a ``MeshModel`` (scope: all in-mesh Services) is fed synthetic
Namespaces, N Services (one TCP port, selector) with 2 remote endpoint pods each, and the
local pods spread over the namespaces; its ``in_scope_services()`` views go to an
``XdsServer`` (not listening) with one simulated delta ADS client that subscribes to
everything and ACKs every response, so "publish" includes the per-stream diff and the
packing of each pushed resource. Measured:

* full build: builder + publish of the whole snapshot to a fresh server; payload bytes by type
* pod ADD / DEL (existing namespace), pod ADD opening a new namespace
* Service change: endpoints only (one pod turns not-ready), a Service added
* agent process RSS (psutil) before the model and after model + builder + server

``--envoy`` also pushes into a real Envoy (needs root: one netns per local pod) and reports
time-to-ACK of the full snapshot and of a pod ADD, plus Envoy's RSS. ``--quick``: 1k only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil

from agent.common.config import NodeConfig
from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_PREFIX,
    LISTENER_TYPE,
    NAMESPACE_LISTENER_PREFIX,
    SHARED_MESH_LISTENER,
    NodeXdsState,
    PodListener,
)
from agent.envoy.xds import TYPE_ORDER, XdsServer, _Stream
from agent.scope.model import MeshModel, ServiceView
from agent.source.base import WatchEvent

NODE = "bench-node"
TARGETS = {"full_build_1k_s": 1.0, "pod_change_s": 0.050, "rss_10k_mb": 250.0,
           # issue #43: changes proportional to what changed, the full build back under 1 s
           "endpoints_change_10k_ms": 20.0, "full_build_10k_s": 1.0}
MB = 1024 * 1024


# ---- synthetic cluster ---------------------------------------------------------------------

def _ns(name: str) -> dict[str, Any]:
    return {"kind": "Namespace", "metadata": {"name": name, "labels": {"aether.io/managed": "true"}}}


def _svc(i: int, ns: str) -> dict[str, Any]:
    ip = f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}"
    return {"kind": "Service", "metadata": {"name": f"svc-{i}", "namespace": ns},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": f"a{i}"},
                     "ports": [{"name": "tcp", "port": 80, "targetPort": 8080}]}}


def _pod(name: str, ns: str, ip: str, node: str, labels: dict[str, str], ready: bool = True,
         uid: str = "") -> dict[str, Any]:
    return {"kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{ns}-{name}",
                         "labels": labels, "annotations": {}},
            "spec": {"nodeName": node, "serviceAccountName": "default",
                     "containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _ep_ip(i: int, k: int) -> str:
    n = 2 * i + k
    return f"10.{128 + n // 65536}.{n // 256 % 256}.{n % 256}"


class Cluster:
    """A MeshModel fed like the agent's source would feed it."""

    def __init__(self, services: int, pods: int, namespaces: int) -> None:
        self.model = MeshModel(node=NodeConfig(node_name=NODE), scope_all=True)
        self.model.defer_scope = True  # as the agent's MeshRuntime feeds it: one event at a time
        self.namespaces = [f"ns{j}" for j in range(namespaces)]
        self.n = services

        def apply(ev: WatchEvent) -> None:
            self.model.apply(ev)
        for ns in self.namespaces:
            apply(WatchEvent("ADDED", "Namespace", _ns(ns)))
        for i in range(services):
            ns = self.namespaces[i % namespaces]
            apply(WatchEvent("ADDED", "Service", _svc(i, ns)))
            for k in range(2):
                apply(WatchEvent("ADDED", "Pod", _pod(f"s{i}-{k}", ns, _ep_ip(i, k), "remote",
                                                      {"app": f"a{i}"})))
        self.local: list[PodListener] = []
        for p in range(pods):
            ns = self.namespaces[p % namespaces]
            ip = f"10.250.{p // 256}.{p % 256}"
            apply(WatchEvent("ADDED", "Pod", _pod(f"local-{p}", ns, ip, NODE, {"role": "client"},
                                                  uid=f"c{p:04d}")))
            self.local.append(self.pod_listener(p, ns))
        self.model.in_scope_keys()  # the publisher's read settles the scope once

    @staticmethod
    def pod_listener(p: int, ns: str, netns: str = "") -> PodListener:
        cid = f"{p:012x}" * 2
        return PodListener(uid=f"cid{cid}", netns_path=netns or f"/var/run/aether/netns/{cid}",
                           namespace=ns)

    def views(self) -> tuple[ServiceView, ...]:
        return tuple(self.model.in_scope_services())

    def endpoint_flip(self, i: int, ready: bool) -> None:
        ns = self.namespaces[i % len(self.namespaces)]
        self.model.apply(WatchEvent("MODIFIED", "Pod", _pod(f"s{i}-0", ns, _ep_ip(i, 0), "remote",
                                                            {"app": f"a{i}"}, ready=ready)))

    def add_service(self) -> None:
        i = self.n
        self.n += 1
        ns = self.namespaces[i % len(self.namespaces)]
        self.model.apply(WatchEvent("ADDED", "Service", _svc(i, ns)))
        for k in range(2):
            self.model.apply(WatchEvent("ADDED", "Pod", _pod(f"s{i}-{k}", ns, _ep_ip(i, k),
                                                             "remote", {"app": f"a{i}"})))


# ---- a simulated delta ADS client ----------------------------------------------------------

class FakeEnvoy:
    """One delta stream on the server: wildcard LDS/CDS, EDS by name; ACKs everything."""

    def __init__(self, server: XdsServer) -> None:
        self.server = server
        self.st: _Stream = server._register(True, "bench")
        self.pushed_bytes = 0
        for t in TYPE_ORDER:
            server._on_request(self.st, t, "", NODE, None, {}, self._req(t, []))
        self.drain()

    @staticmethod
    def _req(t: str, names: list[str]) -> Any:
        from envoy.service.discovery.v3 import discovery_pb2
        return discovery_pb2.DeltaDiscoveryRequest(type_url=t, resource_names_subscribe=names)

    def drain(self) -> None:
        """ACK queued responses; subscribe to EDS names of newly received clusters."""
        while not self.st.out.empty():
            resp = self.st.out.get_nowait()
            if resp is None:
                continue
            self.pushed_bytes += resp.ByteSize()
            self.server._on_request(self.st, resp.type_url, resp.nonce, "", None, None,
                                    self._req(resp.type_url, []))
            if resp.type_url == CLUSTER_TYPE:
                want = [r.name for r in resp.resources if r.name.startswith("svc|")]
                if want:
                    self.server._on_request(self.st, ENDPOINT_TYPE, "", "", None, None,
                                            self._req(ENDPOINT_TYPE, want))

    def publish(self, state: NodeXdsState) -> str:
        v = self.server.set_state(state)
        self.drain()
        return v


# ---- measurement helpers -------------------------------------------------------------------

def rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / MB


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 2)


def payload(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    by_type = {t.rsplit(".", 1)[-1]: sum(m.ByteSize() for m in res[t].values()) for t in TYPE_ORDER}
    lis = res[LISTENER_TYPE]
    pod_sizes = [m.ByteSize() for n, m in lis.items() if n.startswith(LISTENER_PREFIX)]
    # the internal listeners: the shared ``mesh`` and any ``mesh-<ns>`` of its own
    ns_sizes = [m.ByteSize() for n, m in lis.items()
                if n == SHARED_MESH_LISTENER or n.startswith(NAMESPACE_LISTENER_PREFIX)]
    return {
        "bytes_by_type": by_type,
        "total_bytes": sum(by_type.values()),
        "counts": {t.rsplit(".", 1)[-1]: len(res[t]) for t in TYPE_ORDER},
        "pod_listener_bytes": [min(pod_sizes, default=0), max(pod_sizes, default=0)],
        "namespace_listener_bytes": max(ns_sizes, default=0),
        "namespace_listeners": len(ns_sizes),
    }


def run_one(services: int, pods: int, namespaces: int, reps: int) -> dict[str, Any]:
    gc.collect()
    rss0 = rss_mb()
    t_model, cl = timed(lambda: Cluster(services, pods, namespaces))
    t_views, views = timed(cl.views)
    assert len(views) == services, (len(views), services)
    rss_model = rss_mb()

    server = XdsServer(os.path.join(tempfile.gettempdir(), "bench-xds-unused.sock"))
    fake = FakeEnvoy(server)
    state = NodeXdsState(pods=tuple(cl.local), services=views)
    t_build, res = timed(lambda: server._builder.build(state))
    server._builder = type(server._builder)()  # the publish below rebuilds from scratch
    t_full, _ = timed(lambda: fake.publish(state))
    full_push_bytes = fake.pushed_bytes
    out: dict[str, Any] = {
        "services": services, "pods": pods, "namespaces": namespaces,
        "model_s": round(t_model, 2), "model_views_ms": round(t_views * 1000, 1),
        "full_build_s": round(t_build, 3), "full_build_publish_s": round(t_full, 3),
        "full_push_bytes": full_push_bytes,
        **payload(res),
    }
    del res

    # one pod ADD + DEL in an existing namespace (the pod listener only)
    add, rm = [], []
    for r in range(reps):
        extra = cl.pod_listener(10_000 + r, cl.namespaces[r % namespaces])
        st_add = NodeXdsState(pods=state.pods + (extra,), services=views)
        add.append(timed(lambda s=st_add: fake.publish(s))[0])  # type: ignore[misc]
        rm.append(timed(lambda: fake.publish(state))[0])
    out["pod_add_ms"] = median_ms(add)
    out["pod_del_ms"] = median_ms(rm)

    # a pod ADD that opens a new namespace (a new mesh-<ns> cluster, reaching ``mesh``)
    new_ns = []
    for r in range(reps):
        extra = cl.pod_listener(20_000 + r, f"fresh{r}")
        st_add = NodeXdsState(pods=state.pods + (extra,), services=views)
        new_ns.append(timed(lambda s=st_add: fake.publish(s))[0])  # type: ignore[misc]
        fake.publish(state)
    out["pod_add_new_namespace_ms"] = median_ms(new_ns)

    # Service change: endpoints only (model + views + build + publish; and build+publish)
    eps, eps_pub = [], []
    for r in range(reps):
        def flip(r: int = r) -> NodeXdsState:
            cl.endpoint_flip(r, ready=False)
            return NodeXdsState(pods=state.pods, services=cl.views())
        t_model_views, st2 = timed(flip)
        t_pub, _ = timed(lambda s=st2: fake.publish(s))  # type: ignore[misc]
        eps.append(t_model_views + t_pub)
        eps_pub.append(t_pub)
        cl.endpoint_flip(r, ready=True)
        fake.publish(NodeXdsState(pods=state.pods, services=cl.views()))
    out["service_endpoints_change_ms"] = median_ms(eps_pub)
    out["service_endpoints_change_with_model_ms"] = median_ms(eps)

    adds, adds_pub = [], []
    for _ in range(reps):
        def add_svc() -> NodeXdsState:
            cl.add_service()
            return NodeXdsState(pods=state.pods, services=cl.views())
        t_mv, st3 = timed(add_svc)
        t_pub, _ = timed(lambda s=st3: fake.publish(s))  # type: ignore[misc]
        adds.append(t_mv + t_pub)
        adds_pub.append(t_pub)
    out["service_added_ms"] = median_ms(adds_pub)
    out["service_added_with_model_ms"] = median_ms(adds)

    gc.collect()
    out["rss_before_model_mb"] = round(rss0, 1)
    out["rss_model_mb"] = round(rss_model - rss0, 1)
    out["rss_total_mb"] = round(rss_mb(), 1)
    out["_keep"] = (server, cl)  # keep alive until measured; dropped by the caller
    return out


# ---- optional: a real Envoy ------------------------------------------------------------------

def run_envoy(services: int, pods: int, namespaces: int) -> dict[str, Any]:
    """Time-to-ACK in a real Envoy and its RSS; one netns per local pod."""
    from agent.envoy.bootstrap import build_bootstrap, write_bootstrap
    from agent.envoy.supervisor import EnvoySupervisor

    if os.geteuid() != 0:
        return {"skipped": "needs root"}
    tmp = tempfile.mkdtemp(prefix="xds-bench-")
    names = [f"aexb{os.getpid() % 1000}x{p}" for p in range(pods + 1)]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True)
        # a pod's loopback is up (the loopback CNI plugin): the pod listeners bind there
        subprocess.run(["ip", "-n", n, "link", "set", "lo", "up"], check=True)
    cl = Cluster(services, 0, namespaces)
    local = [cl.pod_listener(p, cl.namespaces[p % namespaces], f"/var/run/netns/{names[p]}")
             for p in range(pods)]
    extra = cl.pod_listener(pods, cl.namespaces[0], f"/var/run/netns/{names[pods]}")
    views = cl.views()
    sock = os.path.join(tmp, "xds.sock")
    server = XdsServer(sock)
    server.start()
    admin = os.path.join(tmp, "admin.sock")  # mkdtemp: a 0700 directory
    boot = os.path.join(tmp, "envoy.json")
    write_bootstrap(boot, build_bootstrap("bench", sock, admin))
    sup = EnvoySupervisor(None, boot, admin, base_id=os.getpid() % 60000 + 1000)
    out: dict[str, Any] = {}
    try:
        sup.start()
        v = server.set_state(NodeXdsState(pods=(), services=()))
        server.wait_acked(v, 30)
        state = NodeXdsState(pods=tuple(local), services=views)
        t0 = time.perf_counter()
        v = server.set_state(state)
        ok = server.wait_acked(v, 300)
        out["full_ack_s"] = round(time.perf_counter() - t0, 2) if ok else None
        time.sleep(1)
        add = []
        for _ in range(3):
            t0 = time.perf_counter()
            v = server.set_state(NodeXdsState(pods=state.pods + (extra,), services=views))
            ok = server.wait_acked(v, 60)
            add.append(time.perf_counter() - t0 if ok else float("nan"))
            v = server.set_state(state)
            server.wait_acked(v, 60)
        out["pod_add_ack_ms"] = median_ms(add)
        pid = sup.pid
        out["envoy_rss_mb"] = round(psutil.Process(pid).memory_info().rss / MB, 1) if pid else None
        out["nacks"] = server.status()["nack_count"]
    finally:
        sup.stop(timeout=10)
        server.stop(0.2)
        for n in names:
            subprocess.run(["ip", "netns", "del", n], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- report -----------------------------------------------------------------------------------

ROWS = [
    ("full build (builder only)", "full_build_s", "s"),
    ("full build + publish", "full_build_publish_s", "s"),
    ("payload total", "total_bytes", "MB"),
    ("  Listener bytes", ("bytes_by_type", "Listener"), "MB"),
    ("  Cluster bytes", ("bytes_by_type", "Cluster"), "MB"),
    ("  ClusterLoadAssignment bytes", ("bytes_by_type", "ClusterLoadAssignment"), "MB"),
    ("pod listener bytes (min..max)", "pod_listener_bytes", ""),
    ("internal (mesh) listener bytes, largest", "namespace_listener_bytes", ""),
    ("internal (mesh) listeners", "namespace_listeners", ""),
    ("pod ADD (existing ns)", "pod_add_ms", "ms"),
    ("pod DEL", "pod_del_ms", "ms"),
    ("pod ADD opening a new ns", "pod_add_new_namespace_ms", "ms"),
    ("Service endpoints change", "service_endpoints_change_ms", "ms"),
    ("  incl. model + views", "service_endpoints_change_with_model_ms", "ms"),
    ("Service added", "service_added_ms", "ms"),
    ("  incl. model + views", "service_added_with_model_ms", "ms"),
    ("model build (synthetic feed)", "model_s", "s"),
    ("RSS: model only", "rss_model_mb", "MB"),
    ("RSS: agent process total", "rss_total_mb", "MB"),
]


def _cell(r: dict[str, Any], key: Any, unit: str) -> str:
    v = r[key[0]][key[1]] if isinstance(key, tuple) else r.get(key)
    if v is None:
        return "-"
    if isinstance(v, list):
        return f"{v[0]}..{v[1]}"
    if unit == "MB" and "bytes" in str(key):
        return f"{v / MB:.2f} MB"
    return f"{v} {unit}".strip()


def verdicts(results: list[dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    out: list[tuple[str, bool | None, str]] = []
    by_n = {r["services"]: r for r in results}
    r1 = by_n.get(1000)
    out.append(("full build <= 1 s at 1k Services",
                None if r1 is None else r1["full_build_publish_s"] <= TARGETS["full_build_1k_s"],
                "-" if r1 is None else f"{r1['full_build_publish_s']} s"))
    worst = max(results, key=lambda r: r["services"])
    pod = max(worst["pod_add_ms"], worst["pod_del_ms"])
    out.append((f"one-pod change <= 50 ms (at {worst['services']} Services)",
                pod <= TARGETS["pod_change_s"] * 1000, f"{pod} ms"))
    sizes = {tuple(r["pod_listener_bytes"]) for r in results}
    out.append(("pod listener size independent of Services", len(sizes) == 1,
                ", ".join(f"{a}..{b} B" for a, b in sorted(sizes))))
    r10 = by_n.get(10000)
    out.append(("one Service's endpoints change <= 20 ms at 10k Services",
                None if r10 is None
                else r10["service_endpoints_change_ms"] <= TARGETS["endpoints_change_10k_ms"],
                "-" if r10 is None else f"{r10['service_endpoints_change_ms']} ms"))
    out.append(("full build + publish <= 1 s at 10k Services",
                None if r10 is None else r10["full_build_publish_s"] <= TARGETS["full_build_10k_s"],
                "-" if r10 is None else f"{r10['full_build_publish_s']} s"))
    out.append(("agent RSS <= 250 MB at 10k Services",
                None if r10 is None else r10["rss_total_mb"] <= TARGETS["rss_10k_mb"],
                "-" if r10 is None else f"{r10['rss_total_mb']} MB"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.xds_build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", default="1000,10000")
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--namespaces", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--quick", action="store_true", help="1k Services only (CI smoke, < 30 s)")
    ap.add_argument("--envoy", action="store_true", help="also push into a real Envoy")
    a = ap.parse_args(argv)
    counts = [1000] if a.quick else [int(x) for x in a.services.split(",") if x.strip()]
    results = []
    # Ascending so RSS "before" of a larger run includes no leftovers we could not free.
    for n in sorted(counts):
        print(f"[xds_build] {n} Services x {a.pods} pods / {a.namespaces} namespaces ...",
              file=sys.stderr, flush=True)
        r = run_one(n, a.pods, a.namespaces, 3 if a.quick else a.reps)
        r.pop("_keep")
        if a.envoy:
            r["envoy"] = run_envoy(n, a.pods, a.namespaces)
        results.append(r)
        gc.collect()

    w = max(len(label) for label, _, _ in ROWS) + 2
    print(f"{'':{w}}" + "".join(f"{str(r['services']) + ' Services':>22}" for r in results))
    for label, key, unit in ROWS:
        print(f"{label:{w}}" + "".join(f"{_cell(r, key, unit):>22}" for r in results))
    if a.envoy:
        for k in ("full_ack_s", "pod_add_ack_ms", "envoy_rss_mb", "nacks"):
            print(f"{'envoy ' + k:{w}}" + "".join(f"{str(r['envoy'].get(k)):>22}" for r in results))
    print()
    vs = verdicts(results)
    for name, ok, detail in vs:
        tag = "n/a " if ok is None else ("PASS" if ok else "MISS")
        print(f"  [{tag}] {name}: {detail}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"results": results, "targets": TARGETS,
                       "verdicts": [{"target": n, "pass": ok, "value": d} for n, ok, d in vs]},
                      f, indent=2)
    return 0 if all(ok is not False for _, ok, _ in vs) else 1


if __name__ == "__main__":
    sys.exit(main())
