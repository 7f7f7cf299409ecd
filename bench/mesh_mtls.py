"""The mTLS mesh hop (#16) against the same server reached directly, in the same run.

One `aether-agent run --identity-ca-dir` with its Envoy; a server pod (a captured mesh pod,
ServiceAccount `server`, behind a Service) runs a static 1 KiB `direct_response` Envoy inside
its netns; `wrk` runs in two client pods:

* **mesh**: a captured pod (SA `client`) calling a Service's ClusterIP: capture → the node
  Envoy → mTLS (the client's SVID, the server's SAN pinned, the port in SNI) to the server
  pod's inbound :15008 → delivered inside the server's netns. Three Services on the same
  backend, one per hop shape the Service port's `appProtocol` selects:
  `http` (the HTTP codec on the TLS connection adds `x-forwarded-client-cert`), `tcp` (any
  non-HTTP value: relayed as is) and none (the inbound side detects HTTP in an internal
  listener, then adds XFCC);
* **direct** (the baseline): a pod outside the mesh calling the server pod's address in
  plaintext (the server is PERMISSIVE): the kernel's path with no proxy at all;
* **the floor** (keep-alive only): the least an Envoy-based mTLS hop costs, so the table
  can say how much of the gap is the mesh's and how much Envoy's. A plain Envoy, the same
  binary with one worker like the node Envoy, holding both ends of one hop and nothing
  else: a listener in the client pod's netns, TLS 1.3 with client certificates of the same
  CA to a listener in the server pod's netns, delivered to the server. `floor-tcp`:
  tcp_proxy at both ends (aether's `tcp` does the same work plus capture and its internal
  hops); `floor-http`: the HTTP codec at both ends and XFCC on the server side (aether's
  `http` shape; `detect` runs the codec only on the server side). The floor's upstream
  sockets leave from the node's netns over the bridge, not from the pod's.

Two shapes, each over rounds that run direct, the mesh modes and the floor (for new
connections only `floor-tcp`: the HTTP floor's router would reuse its upstream TLS
connections across callers, no handshake each) in alternating order (ABCD, DCBA), ratios
taken within a round and the median over rounds reported with its spread: keep-alive at
`-c32` (target ≥ 0.5× direct requests/s) and a new connection per request (each is a new TLS
handshake on the mesh side: new TLS connections per second, no target). Root only; needs
`wrk`. Everything is torn down on exit.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from agent.identity.ca_dir import CaDirProvider, make_ca
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
# the floor's client-side ports (in the client pod's netns) and server-side ports (in the
# server pod's), per shape; which aether modes each is the floor of
FLOOR_MODES: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "floor-tcp": (15301, 15308, ("tcp",)),
    "floor-http": (15302, 15309, ("http", "detect")),
}
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


def _tls(certs: str, who: str, downstream: bool) -> dict[str, Any]:
    common = {
        "tls_certificates": [{"certificate_chain": {"filename": f"{certs}/{who}.crt"},
                              "private_key": {"filename": f"{certs}/{who}.key"}}],
        "validation_context": {"trusted_ca": {"filename": f"{certs}/ca.crt"}},
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3",
                       "tls_maximum_protocol_version": "TLSv1_3"}}
    if downstream:
        return {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                     "DownstreamTlsContext",
            "require_client_certificate": True, "common_tls_context": common}}
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": str(SERVER_PORT), "common_tls_context": common}}


def _floor_filter(kind: str, cluster: str, xfcc: bool = False) -> dict[str, Any]:
    if kind == "tcp":
        return {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": cluster, "cluster": cluster}}
    route: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}
    if xfcc:
        route["request_headers_to_add"] = [{"header": {
            "key": "x-forwarded-client-cert",
            "value": "By=%DOWNSTREAM_LOCAL_URI_SAN%;URI=%DOWNSTREAM_PEER_URI_SAN%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": cluster, "generate_request_id": False,
        "forward_client_cert_details": "SANITIZE" if xfcc else "SANITIZE_SET",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True}}]}}


def floor_bootstrap(admin: str, client_netns: str, server_netns: str, server_ip: str,
                    certs: str) -> dict[str, Any]:
    """Both ends of one mTLS hop per floor mode, in one plain Envoy (see the module doc)."""
    def sock(ip: str, port: int, netns: str) -> dict[str, Any]:
        return {"socket_address": {"address": ip, "port_value": port,
                                   "network_namespace_filepath": netns}}

    def static(name: str, port: int, tls: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": "5s",
                             "load_assignment": {"cluster_name": name, "endpoints": [
                                 {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                                     "address": server_ip, "port_value": port}}}}]}]}}
        if tls:
            c["transport_socket"] = _tls(certs, "client", downstream=False)
        return c

    listeners, clusters = [], [static("app", SERVER_PORT, False)]
    for mode, (out_port, in_port, _) in FLOOR_MODES.items():
        kind = mode.removeprefix("floor-")
        listeners.append({"name": f"{mode}-out", "address": sock("127.0.0.1", out_port, client_netns),
                          "filter_chains": [{"filters": [_floor_filter(kind, f"{mode}-hop")]}]})
        listeners.append({"name": f"{mode}-in", "address": sock("0.0.0.0", in_port, server_netns),
                          "filter_chains": [{
                              "filters": [_floor_filter(kind, "app", xfcc=True)],
                              "transport_socket": _tls(certs, "server", downstream=True)}]})
        clusters.append(static(f"{mode}-hop", in_port, True))
    return {"admin": {"address": {"pipe": {"path": admin, "mode": 0o600}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def _floor_certs(ca: str) -> None:
    """The floor's two certificates, from the mesh CA, for the same SPIFFE IDs."""
    provider = CaDirProvider(ca)
    for who in ("client", "server"):
        svid = provider.issue(f"spiffe://cluster.local/ns/{NS}/sa/{who}", time.time())
        for ext, pem in (("crt", svid.cert_chain_pem), ("key", svid.key_pem)):
            with open(os.path.join(ca, f"{who}.{ext}"), "w") as f:
                f.write(pem)


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


def mtls_node(workdir: str, tag: str, net: int, extra: tuple[str, ...] = ()
              ) -> tuple[str, AgentProc, str, Kubelet, Pod, Pod, Pod]:
    """The agent with identity (a CA of its own; ``extra``: more of its flags), a kubelet on
    bridge ``aet<tag><pid>`` and subnet ``10.<net>.0.0/16``, and the client, server and
    outsider pods with their manifests: (ca dir, agent, bridge, kubelet, client, server,
    outsider). Nothing started."""
    ca = os.path.join(workdir, "ca")
    make_ca(ca)
    agent = AgentProc(workdir, envoy=True, extra=["--identity-ca-dir", ca, "--log-level", "info",
                                                  "--listener-timeout", "15", *extra])
    bridge = f"aet{tag}{os.getpid() % 100000}"
    kubelet = Kubelet(workdir, bridge, f"10.{net}.0.0/16", f"fd00:a3e4:{net}::/64",
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    client = kubelet.new_pod(NS, "client")
    server = kubelet.new_pod(NS, "server")
    outsider = kubelet.new_pod("outside", "outsider")
    agent.write("bench.yaml", manifests(client, server, outsider))
    return ca, agent, bridge, kubelet, client, server, outsider


def run(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    ca, agent, bridge, kubelet, client, server, outsider = mtls_node(workdir, "m", 214)
    pods: list[Pod] = []
    srv: ServerEnvoy | None = None
    floor: ServerEnvoy | None = None
    try:
        progress("[mtls] starting the agent with --identity-ca-dir …")
        agent.start()
        for p in (server, client, outsider):
            kubelet.add(p)
            pods.append(p)
        srv = ServerEnvoy(workdir, port=SERVER_PORT, netns_name=server.netns_name)
        srv.start()
        _floor_certs(ca)
        floor = ServerEnvoy(workdir, name="floor-envoy", bootstrap=lambda admin: floor_bootstrap(
            admin, client.netns, server.netns, server.ip(), ca))
        floor.start()
        direct_url = f"http://{server.ip()}:{SERVER_PORT}/"
        urls = {m: f"http://{ip}:80/" for m, (_, ip, _) in MESH_MODES.items()}
        urls.update({m: f"http://127.0.0.1:{out}/" for m, (out, _, _) in FLOOR_MODES.items()})
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
        assert floor.proc is not None
        floor_proc = psutil.Process(floor.proc.pid)  # `ip netns exec` is not in front: no netns
        for shape in ("keepalive", "newconn"):
            # new connections: the tcp_proxy floor only, since the plain Envoy's HTTP router
            # would reuse its upstream TLS connections across callers (no handshake each)
            modes = ["direct", *MESH_MODES,
                     *(FLOOR_MODES if shape == "keepalive" else ("floor-tcp",))]
            runs: list[dict[str, Any]] = []
            for r in range(rounds):
                order = modes if r % 2 == 0 else modes[::-1]
                for i, mode in enumerate(order, 1):
                    progress(f"[mtls] wrk {shape} round {r + 1}/{rounds}: {mode} "
                             f"({i}/{len(order)}, {duration:g} s) …")
                    pod, url = (outsider, direct_url) if mode == "direct" else (client, urls[mode])
                    proxy = floor_proc if mode in FLOOR_MODES else envoy
                    cpu0 = _cpu_s(proxy)
                    w: WrkResult = run_wrk(pod.netns_name, url, duration, WRK_THREADS,
                                           WRK_CONNECTIONS, new_connection=shape == "newconn")
                    cpu = _cpu_s(proxy) - cpu0
                    runs.append({"round": r, "mode": mode, **w.to_json(),
                                 "node_envoy_cpu_s": round(cpu, 3),
                                 "node_envoy_cpu_us_per_request":
                                     round(cpu * 1e6 / w.requests, 1) if w.requests else None})
            direct = {x["round"]: x for x in runs if x["mode"] == "direct"}
            per_mode: dict[str, Any] = {}
            for mode in [m for m in modes if m != "direct"]:
                mesh = [x for x in runs if x["mode"] == mode]
                ratios = sorted(m["rps"] / direct[m["round"]]["rps"] for m in mesh
                                if direct[m["round"]]["rps"] > 0)
                errors = sum(x["socket_errors"] + x["non_2xx"] for x in mesh)
                row = {
                    "app_protocol": MESH_MODES[mode][2] if mode in MESH_MODES else None,
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
                floor_of = [f for f, (_, _, of) in FLOOR_MODES.items() if mode in of]
                if floor_of and floor_of[0] in modes:
                    # aether against the plain Envoy doing the same hop, within each round
                    by_round = {x["round"]: x["rps"] for x in runs if x["mode"] == floor_of[0]}
                    vs = sorted(m["rps"] / by_round[m["round"]] for m in mesh
                                if by_round.get(m["round"]))
                    row["floor_mode"] = floor_of[0]
                    row["vs_floor_ratios"] = [round(x, 3) for x in vs]
                    row["vs_floor_median"] = round(statistics.median(vs), 3) if vs else 0.0
                    row["vs_floor_spread"] = _spread(vs)
                if shape == "keepalive" and mode in MESH_MODES:
                    row["target"] = TARGET_RPS_RATIO
                    row["target_met"] = (row["rps_ratio_median"] >= TARGET_RPS_RATIO
                                         and errors == 0)
                per_mode[mode] = row
                vs_floor = (f"; {row['vs_floor_median']:.2f}× its floor {row['floor_mode']} "
                            f"(spread {row['vs_floor_spread']})" if "floor_mode" in row else "")
                print(f"{shape} {mode}: {row['mesh_rps_median']:.0f} req/s vs direct "
                      f"{row['direct_rps_median']:.0f}: {row['rps_ratio_median']:.2f}× "
                      f"(spread {row['spread']}){vs_floor}, errors {errors}; its Envoy "
                      f"{row['node_envoy_cpu_us_per_request_median']:.0f} µs CPU/request, "
                      f"{row['node_envoy_cpu_share_median']:.2f} CPUs busy", flush=True)
            out["shapes"][shape] = {"runs": runs, "modes": per_mode}
        st = agent.status()
        out["svids"] = [r["identity"] for r in st["envoy"]["identity"]["svids"]]
        return out
    finally:
        if floor is not None:
            floor.stop()
        if srv is not None:
            srv.stop()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def main(argv: list[str] | None = None) -> int:
    return bench_cli("python -m bench.mesh_mtls", __doc__, "wrk", "wrk", "aether-bench-mtls-",
                     run, argv)


if __name__ == "__main__":
    sys.exit(main())
