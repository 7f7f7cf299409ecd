"""Per-request HTTP/2 balancing (#17) against per-connection L4 on the same traffic, same run.

One `aether-agent run` with its Envoy; two backend pods behind two Services that differ only
in the port's `appProtocol`, each backend a static 1 KiB `direct_response` Envoy that speaks
h2c; `h2load` (nghttp2) in a captured client pod, a few connections with many concurrent
streams each, as gRPC clients hold them:

* **per-request** (`appProtocol: kubernetes.io/h2c`): the node Envoy decodes HTTP/2 and
  balances every request over both backends;
* **L4** (no appProtocol, the baseline): the node Envoy relays each connection's bytes to one
  backend chosen at connect time.

The floor of any Envoy-based per-request balancer, in the same run: a **plain Envoy** (the
same binary, one worker, no mesh configuration: a static listener in the host netns, no
capture, no internal listeners, no access logs) relaying the same h2load traffic to the same
two backends once with its HTTP/2 router (per request) and once with its tcp_proxy (per
connection). Its ratio says what Envoy's HTTP/2 codec itself costs against a byte relay on
this machine, whatever the mesh does around it.

Rounds run the four in rotated order; each ratio is taken within a round and the median over
rounds reported with its spread. Target: per-request ≥ 0.9× L4 requests/s. Each run also
reports how its requests split between the backends (the point of it). Root only; needs
`h2load`. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from typing import Any

from bench.common import AgentProc, Kubelet, Pod, bench_cli, progress, teardown_node
from bench.envoy_common import ServerEnvoy, free_port

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


_ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
_H2_UPSTREAM = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}}}}


def plain_bootstrap(admin: str, ports: dict[str, int], backends: list[str]) -> dict[str, Any]:
    """The plain Envoy: 127.0.0.1:<ports["h2"]> an HTTP/2 router (every request balanced
    round-robin over ``backends``), 127.0.0.1:<ports["l4"]> a tcp_proxy (each connection to
    one of them)."""
    def cluster(name: str, h2: bool) -> dict[str, Any]:
        c: dict[str, Any] = {
            "name": name, "type": "STATIC", "connect_timeout": "2s", "lb_policy": "ROUND_ROBIN",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": ip,
                                                             "port_value": SERVER_PORT}}}}
                for ip in backends]}]}}
        if h2:
            c["typed_extension_protocol_options"] = _H2_UPSTREAM
        return c

    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                    ".v3.HttpConnectionManager",
           "stat_prefix": "plain_h2", "codec_type": "AUTO",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
               {"match": {"prefix": "/"}, "route": {"cluster": "h2", "timeout": "0s"}}]}]},
           "http_filters": [_ROUTER]}
    tcp = {"@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
           "stat_prefix": "plain_l4", "cluster": "l4"}
    return {
        "admin": {"address": {"pipe": {"path": admin, "mode": 0o600}}},
        "static_resources": {
            "listeners": [
                {"name": name, "address": {"socket_address": {"address": "127.0.0.1",
                                                               "port_value": ports[name]}},
                 "filter_chains": [{"filters": [{"name": filt, "typed_config": cfg}]}]}
                for name, filt, cfg in (
                    ("h2", "envoy.filters.network.http_connection_manager", hcm),
                    ("l4", "envoy.filters.network.tcp_proxy", tcp))],
            "clusters": [cluster("h2", True), cluster("l4", False)]},
    }


def run_h2load(netns: str | None, url: str, duration: float, connections: int = CONNECTIONS,
               streams: int = STREAMS) -> dict[str, Any]:
    """h2load (h2c prior knowledge) from inside a pod netns (None: the host's) for
    ``duration`` seconds."""
    argv = [*(["ip", "netns", "exec", netns] if netns else []), "h2load", "-c", str(connections), "-t", "1",
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


def _wait_ok(netns: str | None, url: str) -> None:
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
        ports = {"h2": free_port(), "l4": free_port()}
        plain = ServerEnvoy(workdir, name="plain-envoy", bootstrap=lambda admin: plain_bootstrap(
            admin, ports, [s.ip() for s in servers])).start()
        envoys.append(plain)
        # mode -> (netns of h2load, URL): the mesh's two from the captured client pod, the
        # plain Envoy's from the host netns
        targets: dict[str, tuple[str | None, str]] = {
            **{m: (client.netns_name, f"http://{ip}:80/") for m, (_, ip, _) in MODES.items()},
            "plain_h2": (None, f"http://127.0.0.1:{ports['h2']}/"),
            "plain_l4": (None, f"http://127.0.0.1:{ports['l4']}/")}
        for netns, url in targets.values():
            _wait_ok(netns, url)
        backends = envoys[:len(servers)]
        runs: list[dict[str, Any]] = []
        order = list(targets)
        for r in range(rounds):
            k = r % len(order)
            for i, mode in enumerate(order[k:] + order[:k], 1):
                progress(f"[h2] h2load round {r + 1}/{rounds}: {mode} ({i}/{len(order)}, "
                         f"{duration:g} s) …")
                before = [e.requests() for e in backends]
                got = run_h2load(*targets[mode], duration)
                split = [e.requests() - b for e, b in zip(backends, before, strict=True)]
                runs.append({"round": r, "mode": mode, **got, "backend_split": split})
        return summarize(runs, rounds, duration)
    finally:
        for e in envoys:
            e.stop()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def _ratios(runs: list[dict[str, Any]], num: str, den: str) -> list[float]:
    """``num``/``den`` req/s within each round, sorted."""
    by_round: dict[int, dict[str, float]] = {}
    for x in runs:
        by_round.setdefault(x["round"], {})[x["mode"]] = x["rps"]
    return sorted(v[num] / v[den] for v in by_round.values() if v.get(den) and num in v)


def summarize(runs: list[dict[str, Any]], rounds: int, duration: float) -> dict[str, Any]:
    """The figures of the runs (pure): medians, within-round ratios and their spreads, and
    the smaller backend's share of each mode's requests (~0.5 when balanced per request)."""
    def of(mode: str) -> list[dict[str, Any]]:
        return [x for x in runs if x["mode"] == mode]

    def share(mode: str) -> float:
        return round(statistics.median(
            [min(x["backend_split"]) / max(1, sum(x["backend_split"])) for x in of(mode)]), 3)

    def rps(mode: str) -> float:
        return statistics.median([x["rps"] for x in of(mode)])

    ratios, plain = _ratios(runs, "per_request", "l4"), _ratios(runs, "plain_h2", "plain_l4")
    vs_plain = _ratios(runs, "per_request", "plain_h2")
    med = statistics.median(ratios) if ratios else 0.0
    failed = sum(x["failed"] + x["errored"] for x in runs)
    out = {
        "rounds": rounds, "duration_s": duration, "connections": CONNECTIONS,
        "streams": STREAMS, "runs": runs,
        "per_request_rps_median": rps("per_request"), "l4_rps_median": rps("l4"),
        "ratio_median": round(med, 3),
        "spread": [round(ratios[0], 3), round(ratios[-1], 3)] if ratios else [],
        "per_request_min_backend_share_median": share("per_request"),
        "l4_min_backend_share_median": share("l4"),
        "plain_h2_rps_median": rps("plain_h2"), "plain_l4_rps_median": rps("plain_l4"),
        "plain_ratio_median": round(statistics.median(plain), 3) if plain else 0.0,
        "plain_spread": [round(plain[0], 3), round(plain[-1], 3)] if plain else [],
        "plain_h2_min_backend_share_median": share("plain_h2"),
        # what the mesh adds to Envoy's own per-request cost: aether's over the plain router
        "vs_plain_ratio_median": round(statistics.median(vs_plain), 3) if vs_plain else 0.0,
        "vs_plain_spread": [round(vs_plain[0], 3), round(vs_plain[-1], 3)] if vs_plain else [],
        "failed": failed, "target": TARGET_RATIO,
        "target_met": med >= TARGET_RATIO and failed == 0,
    }
    print(f"per-request {out['per_request_rps_median']:.0f} req/s vs L4 "
          f"{out['l4_rps_median']:.0f}: {med:.2f}× (spread {out['spread']}); plain Envoy "
          f"HTTP/2 router {out['plain_h2_rps_median']:.0f} vs its tcp_proxy "
          f"{out['plain_l4_rps_median']:.0f}: {out['plain_ratio_median']:.2f}× (spread "
          f"{out['plain_spread']}); smaller backend's share "
          f"{out['per_request_min_backend_share_median']:.2f} per request, "
          f"{out['l4_min_backend_share_median']:.2f} L4; failed {failed}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python -m bench.h2_balance", __doc__, "h2load", "h2load (nghttp2-client)",
                     "aether-bench-h2-", run, argv)


if __name__ == "__main__":
    sys.exit(main())
