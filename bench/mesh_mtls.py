"""The mTLS mesh hop (#16) against the same server reached directly, in the same run.

One `aether-agent run --identity-ca-dir` with its Envoy; a server pod (a captured mesh pod,
ServiceAccount `server`, behind a Service) runs a static 1 KiB `direct_response` Envoy inside
its netns; `wrk` runs in two client pods:

* **mesh**: a captured pod (SA `client`) calling the Service's ClusterIP: capture → the node
  Envoy → mTLS (HTTP/2 CONNECT, the client's SVID, the server's SAN pinned) to the server pod's
  inbound :15008 → delivered inside the server's netns;
* **direct** (the baseline): a pod outside the mesh calling the server pod's address in
  plaintext (the server is PERMISSIVE): the kernel's path with no proxy at all.

Two shapes, each over ABBA rounds with ratios taken within a pair and the median over pairs
reported with its spread: keep-alive at `-c32` (target ≥ 0.5× direct requests/s) and a new
connection per request (each is a new TLS handshake on the mesh side: new TLS connections per
second, no target). Root only; needs `wrk`. Everything is torn down on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from agent.identity.ca_dir import make_ca
from agent.netns.pin import release_mounts_under
from bench.common import AgentProc, Kubelet, Pod, dumps, machine_info, progress
from bench.envoy_common import ServerEnvoy, WrkResult, run_wrk

NS = "bench"
SVC_IP = "10.96.214.10"
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
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "srv", "namespace": NS},
         "spec": {"clusterIP": SVC_IP, "clusterIPs": [SVC_IP], "selector": {"app": "srv"},
                  "ports": [{"name": "tcp", "port": 80, "targetPort": SERVER_PORT}]}},
        pod(client, "client", {}, {"aether.io/dependencies": "srv"}),
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
        mesh_url = f"http://{SVC_IP}:80/"
        _wait(lambda: run_wrk(client.netns_name, mesh_url, 1, 1, 1).non_2xx == 0
              and run_wrk(client.netns_name, mesh_url, 1, 1, 1).requests > 0, 60,
              "the Service never answered through the mTLS hop")
        for p in (client, outsider):  # as in envoy_path: TIME_WAIT must not exhaust ports
            subprocess.run(["ip", "netns", "exec", p.netns_name, "sysctl", "-qw",
                            "net.ipv4.tcp_tw_reuse=1"], check=True)
        out: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "shapes": {}}
        for shape in ("keepalive", "newconn"):
            runs: list[dict[str, Any]] = []
            order: list[str] = []
            for r in range(rounds):
                order += ["direct", "mesh"] if r % 2 == 0 else ["mesh", "direct"]
            for i, mode in enumerate(order, 1):
                progress(f"[mtls] wrk {shape} {mode} ({i}/{len(order)}, {duration:g} s) …")
                pod, url = (outsider, direct_url) if mode == "direct" else (client, mesh_url)
                w: WrkResult = run_wrk(pod.netns_name, url, duration, WRK_THREADS,
                                       WRK_CONNECTIONS, new_connection=shape == "newconn")
                runs.append({"mode": mode, **w.to_json()})
            direct = [r for r in runs if r["mode"] == "direct"]
            mesh = [r for r in runs if r["mode"] == "mesh"]
            ratios = sorted(m["rps"] / d["rps"] for d, m in zip(direct, mesh, strict=True)
                            if d["rps"] > 0)
            errors = sum(r["socket_errors"] + r["non_2xx"] for r in mesh)
            out["shapes"][shape] = {
                "runs": runs, "rps_ratios": [round(x, 3) for x in ratios],
                "rps_ratio_median": round(statistics.median(ratios), 3) if ratios else 0.0,
                "spread": _spread(ratios),
                "mesh_rps_median": statistics.median([m["rps"] for m in mesh]),
                "direct_rps_median": statistics.median([d["rps"] for d in direct]),
                "mesh_p50_ms_median": statistics.median([m["p50_ms"] for m in mesh]),
                "direct_p50_ms_median": statistics.median([d["p50_ms"] for d in direct]),
                "mesh_errors": errors,
            }
            s = out["shapes"][shape]
            print(f"{shape}: mesh {s['mesh_rps_median']:.0f} req/s vs direct "
                  f"{s['direct_rps_median']:.0f}: {s['rps_ratio_median']:.2f}× "
                  f"(spread {s['spread']}), mesh errors {errors}", flush=True)
        ka = out["shapes"]["keepalive"]
        ka["target"] = TARGET_RPS_RATIO
        ka["target_met"] = ka["rps_ratio_median"] >= TARGET_RPS_RATIO and ka["mesh_errors"] == 0
        st = agent.status()
        out["svids"] = [r["identity"] for r in st["envoy"]["identity"]["svids"]]
        return out
    finally:
        if srv is not None:
            srv.stop()
        for p in reversed(pods):
            try:
                kubelet.delete(p)
            except Exception:  # noqa: BLE001 - best-effort teardown
                subprocess.run(["ip", "netns", "del", p.netns_name], check=False,
                               capture_output=True)
        agent.stop()
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
        release_mounts_under(workdir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mesh_mtls", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s per shape (CI smoke)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("wrk") is None:
        print("bench.mesh_mtls needs root and wrk", file=sys.stderr)
        return 2
    rounds, duration = (1, 2.0) if args.quick else (args.rounds, args.duration)
    workdir = tempfile.mkdtemp(prefix="aether-bench-mtls-")
    try:
        out = run(rounds, duration, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["machine"] = machine_info()
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(out))
    else:
        print(json.dumps(out, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
