"""The mTLS mesh hop (#16) against the same server reached directly, in the same run.

One `aether-agent run --identity-ca-dir` with its Envoy; a server pod (a captured mesh pod,
ServiceAccount `server`, behind a Service) runs a static 1 KiB `direct_response` Envoy inside
its netns; `wrk` runs in two client pods:

* **mesh**: a captured pod (SA `client`) calling a Service's ClusterIP: capture → the node
  Envoy → mTLS (the client's SVID, the server's SAN pinned, the port in SNI) to the server
  pod's inbound :15008 → delivered inside the server's netns. Three Services on the same
  backend, one per hop shape the Service port's `appProtocol` selects:
  `http` (the HTTP codec on the TLS connection adds `x-forwarded-client-cert`), `tcp` (any
  non-HTTP value: relayed as is) and none (the inbound side detects HTTP over the pod's
  loopback, then adds XFCC);
* **direct** (the baseline): a pod outside the mesh calling the server pod's address in
  plaintext (the server is PERMISSIVE): the kernel's path with no proxy at all.

Two shapes, each over rounds that run direct and the three mesh modes in alternating order
(ABCD, DCBA), ratios taken within a round and the median over rounds reported with its
spread: keep-alive at `-c32` (target ≥ 0.5× direct requests/s) and a new connection per
request (each is a new TLS handshake on the mesh side: new TLS connections per second, no
target). Root only; needs `wrk`. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from agent.identity.ca_dir import make_ca
from bench.common import AgentProc, Kubelet, Pod, bench_cli, progress, teardown_node
from bench.envoy_common import ServerEnvoy, WrkResult, run_wrk

NS = "bench"
# mode -> (Service name, ClusterIP, appProtocol)
MESH_MODES: dict[str, tuple[str, str, str | None]] = {
    "http": ("srv-http", "10.96.214.11", "http"),
    "tcp": ("srv-tcp", "10.96.214.12", "tcp"),
    "detect": ("srv", "10.96.214.10", None),
}
SERVER_PORT = 8080
TARGET_RPS_RATIO = 0.5
WRK_THREADS, WRK_CONNECTIONS = 2, 32


def manifests(client: Pod, server: Pod, outsider: Pod) -> list[dict[str, Any]]:
    def pod(p: Pod, sa: str, labels: dict[str, str], ann: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                             "labels": labels, "annotations": ann},
                "spec": {"nodeName": "test-node", "serviceAccountName": sa}}

    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"aether.io/managed": "true"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "outside"}},
        *[{"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
           "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "srv"},
                    "ports": [{"name": "web", "port": 80, "targetPort": SERVER_PORT,
                               **({"appProtocol": app} if app else {})}]}}
          for name, ip, app in MESH_MODES.values()],
        pod(client, "client", {}, {"aether.io/dependencies": ",".join(
            name for name, _, _ in MESH_MODES.values())}),
        pod(server, "server", {"app": "srv"}, {}),
        pod(outsider, "default", {}, {}),
    ]


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (OSError, RuntimeError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(what)


def _spread(xs: list[float]) -> list[float]:
    return [round(min(xs), 3), round(max(xs), 3)] if xs else []


def _cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _workers(p: psutil.Process) -> int:
    return sum(1 for t in p.threads() if _thread_name(p.pid, t.id).startswith("wrk:worker"))


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def run(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    ca = os.path.join(workdir, "ca")
    make_ca(ca)
    agent = AgentProc(workdir, envoy=True, extra=["--identity-ca-dir", ca, "--log-level", "info",
                                                  "--listener-timeout", "15"])
    bridge = f"aetm{os.getpid() % 100000}"
    kubelet = Kubelet(workdir, bridge, "10.214.0.0/16", "fd00:a3e4:214::/64",
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    client = kubelet.new_pod(NS, "client")
    server = kubelet.new_pod(NS, "server")
    outsider = kubelet.new_pod("outside", "outsider")
    agent.write("bench.yaml", manifests(client, server, outsider))
    pods: list[Pod] = []
    srv: ServerEnvoy | None = None
    try:
        progress("[mtls] starting the agent with --identity-ca-dir …")
        agent.start()
        for p in (server, client, outsider):
            kubelet.add(p)
            pods.append(p)
        srv = ServerEnvoy(workdir, port=SERVER_PORT, netns_name=server.netns_name)
        srv.start()
        direct_url = f"http://{server.ip()}:{SERVER_PORT}/"
        urls = {m: f"http://{ip}:80/" for m, (_, ip, _) in MESH_MODES.items()}
        for m, url in urls.items():
            _wait(lambda url=url: run_wrk(client.netns_name, url, 1, 1, 1).non_2xx == 0
                  and run_wrk(client.netns_name, url, 1, 1, 1).requests > 0, 60,
                  f"the Service never answered through the mTLS hop ({m})")
        for p in (client, outsider):  # as in envoy_path: TIME_WAIT must not exhaust ports
            subprocess.run(["ip", "netns", "exec", p.netns_name, "sysctl", "-qw",
                            "net.ipv4.tcp_tw_reuse=1"], check=True)
        out: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "shapes": {}}
        envoy = psutil.Process(int(agent.status()["envoy"]["pid"]))
        out["node_envoy_workers"] = _workers(envoy)
        modes = ["direct", *MESH_MODES]
        for shape in ("keepalive", "newconn"):
            runs: list[dict[str, Any]] = []
            for r in range(rounds):
                order = modes if r % 2 == 0 else modes[::-1]
                for i, mode in enumerate(order, 1):
                    progress(f"[mtls] wrk {shape} round {r + 1}/{rounds}: {mode} "
                             f"({i}/{len(order)}, {duration:g} s) …")
                    pod, url = (outsider, direct_url) if mode == "direct" else (client, urls[mode])
                    cpu0 = _cpu_s(envoy)
                    w: WrkResult = run_wrk(pod.netns_name, url, duration, WRK_THREADS,
                                           WRK_CONNECTIONS, new_connection=shape == "newconn")
                    cpu = _cpu_s(envoy) - cpu0
                    runs.append({"round": r, "mode": mode, **w.to_json(),
                                 "node_envoy_cpu_s": round(cpu, 3),
                                 "node_envoy_cpu_us_per_request":
                                     round(cpu * 1e6 / w.requests, 1) if w.requests else None})
            direct = {x["round"]: x for x in runs if x["mode"] == "direct"}
            per_mode: dict[str, Any] = {}
            for mode in MESH_MODES:
                mesh = [x for x in runs if x["mode"] == mode]
                ratios = sorted(m["rps"] / direct[m["round"]]["rps"] for m in mesh
                                if direct[m["round"]]["rps"] > 0)
                errors = sum(x["socket_errors"] + x["non_2xx"] for x in mesh)
                row = {
                    "app_protocol": MESH_MODES[mode][2],
                    "rps_ratios": [round(x, 3) for x in ratios],
                    "rps_ratio_median": round(statistics.median(ratios), 3) if ratios else 0.0,
                    "spread": _spread(ratios),
                    "mesh_rps_median": statistics.median([m["rps"] for m in mesh]),
                    "direct_rps_median": statistics.median([d["rps"] for d in direct.values()]),
                    "mesh_p50_ms_median": statistics.median([m["p50_ms"] for m in mesh]),
                    "direct_p50_ms_median": statistics.median(
                        [d["p50_ms"] for d in direct.values()]),
                    "mesh_errors": errors,
                    # the node Envoy's CPU per request (both ends of the hop are on it)
                    "node_envoy_cpu_us_per_request_median": statistics.median(
                        [m["node_envoy_cpu_us_per_request"] for m in mesh
                         if m["node_envoy_cpu_us_per_request"] is not None] or [0.0]),
                    "node_envoy_cpu_share_median": round(statistics.median(
                        [m["node_envoy_cpu_s"] / duration for m in mesh]), 2),
                }
                if shape == "keepalive":
                    row["target"] = TARGET_RPS_RATIO
                    row["target_met"] = (row["rps_ratio_median"] >= TARGET_RPS_RATIO
                                         and errors == 0)
                per_mode[mode] = row
                print(f"{shape} {mode}: mesh {row['mesh_rps_median']:.0f} req/s vs direct "
                      f"{row['direct_rps_median']:.0f}: {row['rps_ratio_median']:.2f}× "
                      f"(spread {row['spread']}), mesh errors {errors}; node Envoy "
                      f"{row['node_envoy_cpu_us_per_request_median']:.0f} µs CPU/request, "
                      f"{row['node_envoy_cpu_share_median']:.2f} CPUs busy", flush=True)
            out["shapes"][shape] = {"runs": runs, "modes": per_mode}
        st = agent.status()
        out["svids"] = [r["identity"] for r in st["envoy"]["identity"]["svids"]]
        return out
    finally:
        if srv is not None:
            srv.stop()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python -m bench.mesh_mtls", __doc__, "wrk", "wrk", "aether-bench-mtls-",
                     run, argv)


if __name__ == "__main__":
    sys.exit(main())
