"""Per-request HTTP/2 balancing (#17) against per-connection L4 on the same traffic, same run.

One `aether-agent run` with its Envoy; two backend pods behind two Services that differ only
in the port's `appProtocol`, each backend a static 1 KiB `direct_response` Envoy that speaks
h2c; `h2load` (nghttp2) in a captured client pod, a few connections with many concurrent
streams each, as gRPC clients hold them:

* **per-request** (`appProtocol: kubernetes.io/h2c`): the node Envoy decodes HTTP/2 and
  balances every request over both backends;
* **L4** (no appProtocol, the baseline): the node Envoy relays each connection's bytes to one
  backend chosen at connect time.

Rounds run the two in alternating order (AB, BA); the ratio is taken within a round and the
median over rounds reported with its spread. Target: per-request ≥ 0.9× L4 requests/s. The
per-request run also reports how its requests split between the backends (the point of
it). Root only; needs `h2load`. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from typing import Any

from bench.common import AgentProc, Kubelet, Pod, bench_cli, progress, teardown_node
from bench.envoy_common import ServerEnvoy

NS = "bench"
SERVER_PORT = 8080
TARGET_RATIO = 0.9
CONNECTIONS, STREAMS = 4, 16
# mode -> (Service, ClusterIP, appProtocol)
MODES: dict[str, tuple[str, str, str | None]] = {
    "l4": ("h2-l4", "10.96.215.10", None),
    "per_request": ("h2-lb", "10.96.215.11", "kubernetes.io/h2c"),
}


def manifests(client: Pod, servers: list[Pod]) -> list[dict[str, Any]]:
    def pod(p: Pod, labels: dict[str, str], ann: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                             "labels": labels, "annotations": ann},
                "spec": {"nodeName": "test-node"}}

    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"aether.io/managed": "true"}}},
        *[{"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
           "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "h2"},
                    "ports": [{"name": "web", "port": 80, "targetPort": SERVER_PORT,
                               **({"appProtocol": app} if app else {})}]}}
          for name, ip, app in MODES.values()],
        pod(client, {}, {"aether.io/dependencies": ",".join(n for n, _, _ in MODES.values())}),
        *[pod(s, {"app": "h2"}, {}) for s in servers],
    ]


def run_h2load(netns: str, url: str, duration: float, connections: int = CONNECTIONS,
               streams: int = STREAMS) -> dict[str, Any]:
    """h2load (h2c prior knowledge) from inside a pod netns for ``duration`` seconds."""
    argv = ["ip", "netns", "exec", netns, "h2load", "-c", str(connections), "-t", "1",
            "-m", str(streams), "-D", f"{max(1, round(duration))}", url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    out = r.stdout + r.stderr
    rps = re.search(r"finished in [\d.]+\w*, ([\d.]+) req/s", out)
    done = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, "
                     r"(\d+) failed, (\d+) errored", out)
    if r.returncode != 0 or rps is None or done is None:
        raise RuntimeError(f"h2load failed ({r.returncode}): {out[-1500:]}")
    return {"rps": float(rps.group(1)), "requests": int(done.group(2)),
            "succeeded": int(done.group(3)), "failed": int(done.group(4)),
            "errored": int(done.group(5))}


def _wait_ok(netns: str, url: str) -> None:
    for _ in range(60):
        try:
            got = run_h2load(netns, url, 1, 1, 1)
            if got["succeeded"] > 0 and got["failed"] == 0 and got["errored"] == 0:
                return
        except RuntimeError:
            pass
    raise RuntimeError(f"{url} never answered over h2c")


def run(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    agent = AgentProc(workdir, envoy=True, extra=["--log-level", "info", "--listener-timeout", "15"])
    bridge = f"aeth{os.getpid() % 100000}"
    kubelet = Kubelet(workdir, bridge, "10.215.0.0/16", "fd00:a3e4:215::/64",
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    client = kubelet.new_pod(NS, "client")
    servers = [kubelet.new_pod(NS, f"h2-{i}") for i in range(2)]
    agent.write("bench.yaml", manifests(client, servers))
    pods: list[Pod] = []
    envoys: list[ServerEnvoy] = []
    try:
        progress("[h2] starting the agent …")
        agent.start()
        for p in (*servers, client):
            kubelet.add(p)
            pods.append(p)
        for p in servers:
            envoys.append(ServerEnvoy(workdir, port=SERVER_PORT, netns_name=p.netns_name,
                                      codec="AUTO", name=f"server-{p.name}").start())
        urls = {m: f"http://{ip}:80/" for m, (_, ip, _) in MODES.items()}
        for url in urls.values():
            _wait_ok(client.netns_name, url)
        runs: list[dict[str, Any]] = []
        order = list(MODES)
        for r in range(rounds):
            for i, mode in enumerate(order if r % 2 == 0 else order[::-1], 1):
                progress(f"[h2] h2load round {r + 1}/{rounds}: {mode} ({i}/2, {duration:g} s) …")
                before = [e.requests() for e in envoys]
                got = run_h2load(client.netns_name, urls[mode], duration)
                split = [e.requests() - b for e, b in zip(envoys, before, strict=True)]
                runs.append({"round": r, "mode": mode, **got, "backend_split": split})
        by_round: dict[int, dict[str, float]] = {}
        for x in runs:
            by_round.setdefault(x["round"], {})[x["mode"]] = x["rps"]
        ratios = sorted(v["per_request"] / v["l4"] for v in by_round.values() if v.get("l4"))
        med = statistics.median(ratios) if ratios else 0.0
        lb = [x for x in runs if x["mode"] == "per_request"]
        l4 = [x for x in runs if x["mode"] == "l4"]
        # the smaller backend's share of each run: ~0.5 when balanced per request
        share = [min(x["backend_split"]) / max(1, sum(x["backend_split"])) for x in lb]
        l4_share = [min(x["backend_split"]) / max(1, sum(x["backend_split"])) for x in l4]
        failed = sum(x["failed"] + x["errored"] for x in runs)
        out = {
            "rounds": rounds, "duration_s": duration, "connections": CONNECTIONS,
            "streams": STREAMS, "runs": runs,
            "per_request_rps_median": statistics.median([x["rps"] for x in lb]),
            "l4_rps_median": statistics.median([x["rps"] for x in l4]),
            "ratio_median": round(med, 3),
            "spread": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else [],
            "per_request_min_backend_share_median": round(statistics.median(share), 3),
            "l4_min_backend_share_median": round(statistics.median(l4_share), 3),
            "failed": failed, "target": TARGET_RATIO,
            "target_met": med >= TARGET_RATIO and failed == 0,
        }
        print(f"per-request {out['per_request_rps_median']:.0f} req/s vs L4 "
              f"{out['l4_rps_median']:.0f}: {med:.2f}× (spread {out['spread']}); smaller "
              f"backend's share {out['per_request_min_backend_share_median']:.2f} per request, "
              f"{out['l4_min_backend_share_median']:.2f} L4; failed {failed}", flush=True)
        return out
    finally:
        for e in envoys:
            e.stop()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python -m bench.h2_balance", __doc__, "h2load", "h2load (nghttp2-client)",
                     "aether-bench-h2-", run, argv)


if __name__ == "__main__":
    sys.exit(main())
