"""The pod DNS (#42) against the cluster DNS reached directly, in the same run.

One ``aether-agent run`` (Envoy on, DNS capture on: the default), a cluster DNS (the test
double, ``agent.testing.dns_double``) in a pod outside the mesh, and two captured clients:
``cap`` (its DNS captured) and ``off`` (``capture.aether.io/dns: "false"``: its queries go
straight to the cluster DNS, the baseline: the kernel's path there and back is the floor).
Each round runs, in alternating order, ``--queries`` sequential UDP queries of each kind,
timed one by one inside the pod's netns:

* **direct**: ``off`` asks ``known.bench.svc.cluster.local`` (the cluster DNS answers);
* **forwarded**: ``cap`` asks the same name: captured, forwarded from the pod's netns by the
  pod DNS, the answer relayed;
* **mesh**: ``cap`` asks ``echo.bench.aether.internal``: answered by the pod DNS (the name
  looked up in the agent), the cluster DNS never asked.

Figures per kind: the median latency of a round's queries, the median over rounds with its
spread; what the pod DNS adds to a forwarded query (forwarded − direct, µs); CPU per query
of the pod DNS process and of the agent (its lookups), from their CPU times over the batch.
Root only. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import psutil

from agent.dns import wire
from agent.netns.enter import run_in_netns
from agent.testing.dns_double import ClusterDns, build_query
from bench.common import AgentProc, Kubelet, Pod, bench_cli, progress, teardown_node
from bench.mesh_mtls import _spread

NS = "bench"
SVC_IP = "10.96.215.10"
KINDS = ("direct", "forwarded", "mesh")
NAMES = {"direct": "known.bench.svc.cluster.local", "forwarded": "known.bench.svc.cluster.local",
         "mesh": f"echo.{NS}.aether.internal"}
QUERIES = 400


def _manifests(cap: Pod, off: Pod, dns: Pod) -> list[dict[str, Any]]:
    def pod(p: Pod, annotations: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                             "labels": {}, "annotations": annotations},
                "spec": {"nodeName": "test-node", "serviceAccountName": "default"}}
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"aether.io/managed": "true"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "outside"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": NS},
         "spec": {"clusterIP": SVC_IP, "clusterIPs": [SVC_IP], "selector": {"app": "echo"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}},
        pod(cap, {}), pod(off, {"capture.aether.io/dns": "false"}), pod(dns, {}),
    ]


def batch(netns: str, server: str, name: str, n: int) -> list[float]:
    """``n`` queries one after the other from inside ``netns``: each one's seconds."""
    query = build_query(name)

    def work() -> list[float]:
        out = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(2.0)
            s.connect((server, 53))  # one source port: as a resolver library keeps it
            for i in range(n):
                q = bytes([i >> 8 & 0xFF, i & 0xFF]) + query[2:]
                t0 = time.perf_counter()
                s.send(q)
                while True:
                    got = s.recv(4096)
                    if got[:2] == q[:2]:
                        break
                out.append(time.perf_counter() - t0)
                if wire.HEADER.unpack_from(got)[3] < 1:
                    raise AssertionError(f"{name}: no answer record")
        return out
    return run_in_netns(netns, work, timeout=120)


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def run(rounds: int, duration: float, workdir: str, queries: int = QUERIES) -> dict[str, Any]:
    del duration  # a DNS round is counted in queries
    agent = AgentProc(workdir, envoy=True, extra=["--log-level", "info"])
    bridge = f"aetd{os.getpid() % 100000}"
    kubelet = Kubelet(workdir, bridge, "10.215.0.0/16", "fd00:a3e4:215::/64",
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    cap, off = kubelet.new_pod(NS, "cap"), kubelet.new_pod(NS, "off")
    dns_pod = kubelet.new_pod("outside", "coredns")
    agent.write("bench.yaml", _manifests(cap, off, dns_pod))
    pods: list[Pod] = []
    cluster: ClusterDns | None = None
    try:
        progress("[dns] starting the agent (DNS capture on) …")
        agent.start()
        for p in (dns_pod, cap, off):
            kubelet.add(p)
            pods.append(p)
        cluster = ClusterDns(dns_pod.netns,
                             records={NAMES["direct"]: ("10.96.99.99",)}).start()
        server = dns_pod.ip()
        status = agent.status()
        dns_proc = psutil.Process(int(status["dns"]["pid"]))
        agent_proc = psutil.Process(agent.proc.pid if agent.proc else 0)
        deadline = time.monotonic() + 20
        while True:  # the Service in the model: the mesh name answers
            try:
                batch(cap.netns, server, NAMES["mesh"], 1)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for kind in KINDS:  # warm-up
            batch(off.netns if kind == "direct" else cap.netns, server, NAMES[kind], 50)
        per_round: list[dict[str, Any]] = []
        for r in range(rounds):
            order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))
            got: dict[str, Any] = {}
            for kind in order:
                progress(f"[dns] round {r + 1}/{rounds}: {kind} ({queries} queries) …")
                c0, a0 = _cpu(dns_proc), _cpu(agent_proc)
                times = batch(off.netns if kind == "direct" else cap.netns, server,
                              NAMES[kind], queries)
                got[kind] = {"median_us": statistics.median(times) * 1e6,
                             "p99_us": sorted(times)[int(len(times) * 0.99) - 1] * 1e6,
                             "pod_dns_cpu_us": (_cpu(dns_proc) - c0) / queries * 1e6,
                             "agent_cpu_us": (_cpu(agent_proc) - a0) / queries * 1e6}
            got["forwarded_added_us"] = got["forwarded"]["median_us"] - got["direct"]["median_us"]
            per_round.append(got)

        def med(f: Any) -> dict[str, Any]:
            vals = [f(x) for x in per_round]
            return {"median": round(statistics.median(vals), 1), "spread": _spread(vals)}
        out: dict[str, Any] = {"rounds": rounds, "queries_per_kind": queries}
        for kind in KINDS:
            out[kind] = {k: med(lambda x, k=k, kind=kind: x[kind][k])
                         for k in ("median_us", "p99_us", "pod_dns_cpu_us", "agent_cpu_us")}
        out["forwarded_added_us"] = med(lambda x: x["forwarded_added_us"])
        out["forwarded_over_direct"] = med(
            lambda x: x["forwarded"]["median_us"] / x["direct"]["median_us"])
        out["mesh_over_direct"] = med(lambda x: x["mesh"]["median_us"] / x["direct"]["median_us"])
        out["cluster_dns_saw_mesh_names"] = sum(
            1 for n in cluster.names_seen() if n.endswith("aether.internal"))
        return out
    finally:
        if cluster is not None:
            cluster.close()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python3 -m bench.dns", __doc__, "ip", "iproute2", "aether-dns-bench-",
                     run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
