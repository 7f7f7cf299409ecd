"""What the golden traffic metrics (#19) cost on the data path: the same traffic through an
`aether-agent run` with its Envoy, traffic metrics on (the default) against
`--no-traffic-metrics`, same run.

Each (round, mode) gets a node of its own, made the same way: the agent and its Envoy, a
client pod and a server pod (a static 1 KiB `direct_response` Envoy) behind two Services on
the same pod, and `wrk` in the client pod:

* **http keep-alive**: Service `web` (`appProtocol: http`: the HTTP chain, one histogram
  sample with one packed tag per request in Envoy), `wrk -t2 -c32` over kept-alive
  connections;
* **tcp new connection**: Service `raw` (no appProtocol: L4, one counter per connection),
  `wrk -t2 -c32 -H 'Connection: close'`: a connection per request.

Modes alternate (AB, BA) over rounds (an even number keeps either mode from always being
the second node of a round); the on/off ratio is taken within a round and the
median over rounds is reported with its spread. Target: metrics on ≥ 0.95× metrics off for
both shapes. The "on" runs also check the metrics counted what wrk sent (requests_counted;
it may exceed wrk's count by the requests in flight when wrk stops, at most 32). CPU per
request of the agent and of the node Envoy is reported beside each figure.
Root only; needs `wrk`. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from typing import Any

import psutil

from bench.common import AgentProc, Kubelet, Pod, bench_cli, progress, teardown_node
from bench.envoy_common import ServerEnvoy, run_wrk

NS = "bench"
SERVER_PORT = 8080
TARGET_RATIO = 0.95
SETTLE_S = 3.0
FLUSH_S = 5.5  # Envoy's stats flush (5 s): its request histograms are merged then
WEB_IP, RAW_IP = "10.96.216.10", "10.96.216.11"
SHAPES = {"http_keepalive": (WEB_IP, False), "tcp_newconn": (RAW_IP, True)}
MODES = {"on": [], "off": ["--no-traffic-metrics"]}


def manifests(client: Pod, server: Pod) -> list[dict[str, Any]]:
    def pod(p: Pod, labels: dict[str, str], ann: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                             "labels": labels, "annotations": ann},
                "spec": {"nodeName": "test-node"}}

    def svc(name: str, ip: str, app: str | None) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
                "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "srv"},
                         "ports": [{"name": "web", "port": 80, "targetPort": SERVER_PORT,
                                    **({"appProtocol": app} if app else {})}]}}

    return [{"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": NS, "labels": {"aether.io/managed": "true"}}},
            svc("web", WEB_IP, "http"), svc("raw", RAW_IP, None),
            pod(client, {}, {"aether.io/dependencies": "web,raw"}),
            pod(server, {"app": "srv"}, {})]


def _counted(agent: AgentProc) -> float:
    text = agent.http("/metrics")[1]
    return sum(float(m.group(1)) for m in re.finditer(
        r'^aether_requests_total\{[^}]*dst_service="web"[^}]*\} (\S+)$', text, re.M))


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the agent itself, and of its node Envoy (a descendant)."""
    agent = psutil.Process(pid)
    t = agent.cpu_times()
    own = t.user + t.system
    envoy = 0.0
    for child in agent.children(recursive=True):
        try:
            if child.name() == "envoy":
                ct = child.cpu_times()
                envoy += ct.user + ct.system
        except psutil.Error:
            continue
    return own, envoy


def one_node(workdir: str, mode: str, duration: float, tag: str) -> dict[str, Any]:
    """A fresh node with the agent in ``mode``; every shape measured once."""
    wd = os.path.join(workdir, tag)
    os.makedirs(wd)
    agent = AgentProc(wd, envoy=True, extra=["--log-level", "info", "--listener-timeout", "15",
                                             *MODES[mode]])
    bridge = f"aetm{os.getpid() % 10000}{tag[-2:]}"
    kubelet = Kubelet(wd, bridge, "10.216.0.0/16", "fd00:a3e4:216::/64",
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    client, server = kubelet.new_pod(NS, "client"), kubelet.new_pod(NS, "srv-0")
    agent.write("bench.yaml", manifests(client, server))
    pods: list[Pod] = []
    envoy: ServerEnvoy | None = None
    try:
        agent.start()
        for p in (server, client):
            kubelet.add(p)
            pods.append(p)
        envoy = ServerEnvoy(wd, port=SERVER_PORT, netns_name=server.netns_name,
                            name="server").start()
        for ip, _new in SHAPES.values():  # both Services answer before anything is timed
            deadline = time.monotonic() + 30
            while run_wrk(client.netns_name, f"http://{ip}/", 1, 1, 1).requests == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ip} never answered through the capture")
        out: dict[str, Any] = {"mode": mode}
        for shape, (ip, new) in SHAPES.items():
            if mode == "on":  # the warm-up's requests are in (Envoy merges histograms every 5 s)
                time.sleep(FLUSH_S)
            before = _counted(agent)
            assert agent.proc is not None
            cpu0 = _cpu(agent.proc.pid)
            got = run_wrk(client.netns_name, f"http://{ip}/", duration, new_connection=new)
            cpu1 = _cpu(agent.proc.pid)
            out[shape] = got.to_json()
            # CPU per request, µs: the agent (its share of the metrics) and the node Envoy
            out[shape]["agent_cpu_us_per_request"] = round(
                1e6 * (cpu1[0] - cpu0[0]) / max(1, got.requests), 2)
            out[shape]["envoy_cpu_us_per_request"] = round(
                1e6 * (cpu1[1] - cpu0[1]) / max(1, got.requests), 2)
            if shape == "http_keepalive" and mode == "on":
                time.sleep(FLUSH_S)
                out[shape]["requests_counted"] = _counted(agent) - before
        return out
    finally:
        if envoy is not None:
            envoy.stop()
        teardown_node(kubelet, pods, agent, bridge, wd)


def run(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    order = list(MODES)
    for r in range(rounds):
        for i, mode in enumerate(order if r % 2 == 0 else order[::-1], 1):
            progress(f"[metrics] round {r + 1}/{rounds}: traffic metrics {mode} ({i}/2, "
                     f"{len(SHAPES)} shapes × {duration:g} s) …")
            runs.append({"round": r, **one_node(workdir, mode, duration, f"r{r}{mode}")})
            time.sleep(SETTLE_S)  # the last node's teardown is not the next one's load
    out: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "runs": runs,
                           "target": TARGET_RATIO}
    met = True
    for shape in SHAPES:
        by_round: dict[int, dict[str, float]] = {}
        for x in runs:
            by_round.setdefault(x["round"], {})[x["mode"]] = x[shape]["rps"]
        ratios = sorted(v["on"] / v["off"] for v in by_round.values() if v.get("off"))
        med = statistics.median(ratios) if ratios else 0.0
        errors = sum(x[shape]["socket_errors"] + x[shape]["non_2xx"] for x in runs)
        out[shape] = {
            "on_rps_median": statistics.median(x[shape]["rps"] for x in runs if x["mode"] == "on"),
            "off_rps_median": statistics.median(x[shape]["rps"] for x in runs
                                                if x["mode"] == "off"),
            "ratio_median": round(med, 3),
            "spread": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else [],
            "errors": errors,
            **{f"{who}_cpu_us_per_request_{m}": statistics.median(
                x[shape][f"{who}_cpu_us_per_request"] for x in runs if x["mode"] == m)
               for who in ("agent", "envoy") for m in MODES}}
        met = met and med >= TARGET_RATIO and errors == 0
        print(f"{shape}: metrics on {out[shape]['on_rps_median']:.0f} req/s vs off "
              f"{out[shape]['off_rps_median']:.0f}: {med:.3f}× (spread {out[shape]['spread']})",
              flush=True)
    counted = [x["http_keepalive"] for x in runs if x["mode"] == "on"]
    out["http_requests_sent"] = sum(c["requests"] for c in counted)
    out["http_requests_counted"] = sum(c.get("requests_counted", 0) for c in counted)
    out["target_met"] = met
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python -m bench.traffic_metrics", __doc__, "wrk", "wrk",
                     "aether-bench-metrics-", run, argv)


if __name__ == "__main__":
    sys.exit(main())
