"""The agent's status document: what `aether-agent status` (and `status <pod>`) shows.

Split out of ``agent.runtime.app`` (the composition) because the document is long and only
reads the agent: every captured pod with its rules and listener as Envoy holds them, the
subsystems' own status, the take-over and CNI-install state, one pod in depth (its rules, its
AuthorizationPolicies, where a destination would go), and the status socket's requests. The
agent is read through ``StatusHost``, the part of it this module needs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agent import __version__
from agent.cni.handler import ListenerSink
from agent.cni.server import UnixJsonServer
from agent.cni.state import CapturedPod
from agent.common.config import NodeConfig
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane
from agent.runtime.options import AgentOptions
from agent.runtime.parts import AgentParts
from agent.source.base import MetadataSource

if TYPE_CHECKING:  # the subsystems' types; their modules load only when started
    from agent.gamma.status import StatusLoop
    from agent.meshpods.publisher import MeshPodPublisher
    from agent.node.readiness import ReadinessLoop
    from agent.runtime.enroll import EnrollmentLoop
    from agent.scope.model import MeshModel
    from agent.slices.writer import SliceProjector

log = logging.getLogger("aether.agent")

NO_PROXY = "n/a (no proxy)"  # a pod's listener state when the agent runs without Envoy


class MeshStatus(Protocol):
    """What the status reads of the mesh runtime."""

    @property
    def model(self) -> MeshModel: ...

    def status(self) -> dict[str, Any]: ...


class StatusHost(AgentParts, Protocol):
    """The running agent as the status document reads it (``agent.runtime.app.Agent``)."""

    @property
    def node(self) -> NodeConfig: ...
    @property
    def source(self) -> MetadataSource: ...
    @property
    def dataplane(self) -> CaptureDataplane: ...
    @property
    def mesh(self) -> MeshStatus | None: ...
    @property
    def readiness(self) -> ReadinessLoop | None: ...
    @property
    def slices(self) -> SliceProjector | None: ...
    @property
    def meshpods(self) -> MeshPodPublisher | None: ...
    @property
    def gamma_status(self) -> StatusLoop | None: ...
    @property
    def enrollment(self) -> EnrollmentLoop | None: ...
    @property
    def cni_server(self) -> UnixJsonServer: ...
    @property
    def status_server(self) -> UnixJsonServer: ...
    @property
    def started_at(self) -> float: ...
    @property
    def reconcile_report(self) -> list[str]: ...
    @property
    def pin_dir(self) -> str: ...
    @property
    def pin_peer_group(self) -> str: ...
    @property
    def on_exit_request(self) -> Callable[[], None] | None: ...

    def envoy_sees_pins(self) -> bool | None: ...
    def status(self) -> dict[str, Any]: ...
    def takeover_state(self) -> dict[str, Any]: ...
    def cni_install_state(self) -> dict[str, Any]: ...
    def hello(self) -> dict[str, Any]: ...
    def release_all(self, why: str) -> dict[str, Any]: ...
    def pod_status(self, key: str, dest: str | None, caller: str | None = None,
                   port: int | None = None) -> dict[str, Any]: ...


def status(agent: StatusHost) -> dict[str, Any]:
    """The whole document (``Agent.status``)."""
    c = agent.handler.counters
    pods = []
    records = sorted(agent.store.all(), key=lambda x: x.key)
    listeners = listener_states(agent.sink, [p.container_id for p in records])
    for pod in records:
        try:
            live = agent.dataplane.live_fingerprint(pod.netns)
            verified = "ok" if live == pod.fingerprint else ("missing" if live is None else "drift")
        except DATAPLANE_ERRORS as e:
            verified = f"error: {e}"
        pods.append({
            "pod": pod.key,
            "uid": pod.uid,
            "container_id": pod.container_id,
            "service_account": pod.service_account,
            "mode": pod.policy.mode,
            "ips": pod.ips,
            "netns": pod.netns,
            "exclude_ports": [f"{a}-{b}" if a != b else str(a) for a, b in pod.policy.exclude_ports],
            "exclude_cidrs": list(pod.policy.exclude_v4 + pod.policy.exclude_v6),
            "rules": verified,
            "problems": [str(x) for x in pod.problems],
            "net_admin": pod.net_admin,
            # as Envoy holds it: live, missing, rejected, draining, stopped, unknown, …
            "listener": listeners[pod.container_id][0],
            "listener_detail": listeners[pod.container_id][1],
        })
    enrollment = agent.enrollment
    out: dict[str, Any] = {
        "version": __version__,
        "node": agent.node.node_name,
        "uptime_s": round(time.time() - agent.started_at, 1),
        "source": agent.source.describe(),
        "run_dir": agent.node.run_dir,
        "counters": vars(c).copy(),
        "pods": pods,
        "warnings": list(agent.handler.recent_problems) + [
            {"pod": p["pod"], "reason": "NetAdminPod",
             "message": "holds NET_ADMIN (or is privileged): it could set the passthrough "
                        "mark on its own sockets and bypass capture"}
            for p in pods if p["net_admin"]],
        "reconcile": list(agent.reconcile_report),
        # running pods ADD left uncaptured, watched for a label/annotation that captures them
        "live_enrollment": {
            "enabled": enrollment is not None,
            "watched_uncaptured": len(agent.store.all_seen()),
            "passes": enrollment.passes if enrollment is not None else 0,
            "discovered": enrollment.discovered if enrollment is not None else 0,
            # to be captured, started before aether, netns not found by IP (yet)
            "not_found": sorted(enrollment.not_found.values())
            if enrollment is not None else [],
        },
        "pin_dir": {"path": agent.pin_dir, "propagation": agent.pin_peer_group or "private",
                    "envoy_sees_pins": agent.envoy_sees_pins()},
        "source_problems": source_problems(agent.source, agent.mesh),
        "refused_busy": {"cni": agent.cni_server.refused, "status": agent.status_server.refused},
        "events": agent.handler.events.status(),
        "capture_integrity": {
            "proxy_match": (f'mark + socket cgroupv2 level {agent.node.proxy_cgroup_level} '
                            f'"{agent.node.proxy_cgroup}"' if agent.node.proxy_cgroup
                            else "mark only"),
            "problem": agent.node.proxy_cgroup_problem,
            "cgroup": agent.node.proxy_cgroup,
            "level": agent.node.proxy_cgroup_level,
        },
    }
    out["takeover"] = agent.takeover_state()
    out["cni_install"] = agent.cni_install_state()
    if agent.mesh is not None:
        out["mesh"] = agent.mesh.status()
    if agent.repair is not None:
        out["capture_missing"] = agent.repair.status()
    if agent.readiness is not None:
        out["readiness"] = agent.readiness.status()
    if agent.slices is not None:
        out["endpoint_slices"] = agent.slices.status()
    if agent.meshpods is not None:
        out["meshpods"] = {**agent.meshpods.status(), "remote_pods": agent.options.remote_pods}
    if agent.gamma_status is not None:
        out["route_status"] = agent.gamma_status.status()
    extra = getattr(agent.sink, "status", None)
    if callable(extra):
        out["envoy"] = extra()
    dns = getattr(agent.sink, "dns", None)
    if dns is not None:
        out["dns"] = {"port": agent.node.dns_port, **dns.stats()}
    out["degraded"] = bool(agent.node.proxy_cgroup_problem) or bool(
        dns is not None and dns.serving_any() and not out["dns"].get("up")) or any(
        p["rules"] != "ok" or p["listener"] not in ("live", NO_PROXY) for p in pods) or bool(
        out.get("envoy", {}).get("degraded")
    )
    return out


def source_problems(source: MetadataSource, mesh: object | None) -> list[str]:
    """What the metadata source cannot use (e.g. a manifest that fails to parse and is
    served from its last good version), from the CNI lookups' source and the watcher."""
    holders: list[Any] = [source, getattr(source, "inner", None)]
    if mesh is not None:
        holders.append(getattr(mesh, "watcher", None))
    seen: list[str] = []
    for holder in holders:
        for problem in getattr(holder, "problems", None) or []:
            if str(problem) not in seen:
                seen.append(str(problem))
    return seen


def listener_states(sink: ListenerSink, container_ids: list[str]) -> dict[str, tuple[str, str]]:
    """(state, detail) of each pod's listener as the proxy holds it — never the agent's
    intent: a NACKed, draining or stopped listener is not live. Only "live" is healthy."""
    ask = getattr(sink, "listener_states", None)
    if not callable(ask):
        return {cid: (NO_PROXY, "") for cid in container_ids}
    try:
        states = ask(container_ids)
        return {cid: (states[cid].state, states[cid].detail) for cid in container_ids}
    except Exception as e:  # noqa: BLE001 - status must answer whatever the proxy does
        log.exception("reading the proxy's listeners failed")
        return {cid: ("unknown", f"reading the proxy's listeners failed: {e}")
                for cid in container_ids}


def cni_install_state(options: AgentOptions, run_dir: str) -> dict[str, Any]:
    """Which conflist kubelet uses, whether our entry and binary are there, last repair."""
    from agent.install import conflist as cl
    from agent.install.installer import read_configs
    o = options
    out: dict[str, Any] = {"conf_dir": o.cni_conf_dir}
    try:
        files = read_configs(o.cni_conf_dir)
    except OSError as e:
        return {**out, "error": str(e)}
    name = cl.select_config(files)
    out["conflist"] = os.path.join(o.cni_conf_dir, name) if name else None
    try:  # the readiness check's own rule: ours is the last plugin, once
        out["entry_present"] = name is not None and cl.has_entry(cl.parse(files[name]))
    except cl.ConfigError:
        out["entry_present"] = False
    out["plugin_present"] = os.access(os.path.join(o.cni_bin_dir, "aether-cni"), os.X_OK)
    try:
        with open(os.path.join(run_dir, "cni-install.json")) as f:
            watcher = json.load(f)
        out["repairs"] = watcher.get("repairs")
        out["last_repair"] = watcher.get("last_repair")
    except (OSError, ValueError):
        out["repairs"] = None
    return out


def pod_authz(sink: ListenerSink, pod: CapturedPod, caller: str | None, port: int | None
              ) -> dict[str, Any]:
    """The AuthorizationPolicies its inbound listener enforces and, for ``caller`` (a
    SPIFFE ID; "" a plaintext caller), the decision at L4 on ``port``."""
    from agent.authz.policy import Request, decide, describe
    authz_of = getattr(sink, "authz_of", None)
    policies = authz_of(pod.container_id) if callable(authz_of) else ()
    out: dict[str, Any] = {"policies": describe(policies),
                           "plaintext_judged": pod.policy.judged}
    if caller is not None:
        d = decide(policies, Request(port=port or 0, principal=caller or None))
        out["from"] = {"caller": caller or "(plaintext)", "port": port,
                       "allowed": d.allowed, "reason": d.reason,
                       "audited": list(d.audited)}
    return out


def pod_status(agent: StatusHost, key: str, dest: str | None, caller: str | None = None,
               port: int | None = None) -> dict[str, Any]:
    """One pod in depth: rules as programmed, its listener, where dest would go and,
    with ``caller``, what its AuthorizationPolicies decide for that caller."""
    pods = [p for p in agent.store.all() if p.key == key]
    if not pods:
        return {"ok": False, "msg": f"pod {key} is not captured on this node"}
    pod = pods[0]
    out: dict[str, Any] = {"pod": key, "container_id": pod.container_id, "netns": pod.netns,
                           "mode": pod.policy.mode, "reason": pod.reason, "ips": pod.ips,
                           "problems": [str(x) for x in pod.problems]}
    try:
        out["rules"] = agent.dataplane.listing(pod.netns)
        live = agent.dataplane.live_fingerprint(pod.netns)
        out["rules_verified"] = "ok" if live == pod.fingerprint else "drift"
    except DATAPLANE_ERRORS as e:
        out["rules"], out["rules_verified"] = None, f"error: {e}"
    out["listener"] = f"capture-{pod.container_id}"
    state, detail = listener_states(agent.sink, [pod.container_id])[pod.container_id]
    out["listener_state"], out["listener_detail"] = state, detail
    out["listener_live"] = None if state in (NO_PROXY, "unknown") else state == "live"
    out["degraded"] = out["rules_verified"] != "ok" or state not in ("live", NO_PROXY)
    out["authorization"] = pod_authz(agent.sink, pod, caller, port)
    if dest:
        from agent.capture.explain import explain_destination
        host, _, dport = dest.rpartition(":")
        host = host.strip("[]")
        services: dict[tuple[str, int], str] = {}
        if agent.mesh is not None:
            for view in agent.mesh.model.in_scope_services():
                for ip in view.cluster_ips:
                    for sp in view.ports:
                        services[(ip, sp.port)] = view.key
        try:
            out["dest"] = {"address": dest, "verdict": explain_destination(
                pod.policy, pod.ips, host, int(dport), services)}
        except ValueError:
            out["dest"] = {"address": dest, "verdict": "expected IP:port"}
    return {"ok": True, "pod": out}


def status_request(agent: StatusHost, request: Any) -> dict[str, Any]:
    """`{"command": "status"}` or `{"command": "pod", "pod": "<ns>/<name>", "dest":
    "IP:port" | null}`; anything else is answered with what was expected."""
    if not isinstance(request, dict):
        return {"ok": False, "msg": "expected a JSON object"}
    command = request.get("command")
    if command == "status":
        return {"ok": True, "status": agent.status()}
    if command == "hello":  # a successor starting on this run dir (agent.runtime.takeover)
        return {"ok": True, "hello": agent.hello()}
    if command == "traffic":  # aether-agent top
        xds = getattr(agent.sink, "xds", None)
        if xds is None:
            return {"ok": False, "msg": "no Envoy on this node: no traffic metrics"}
        try:  # the golden metrics and Envoy's own figures, from Envoy's stats
            figures = agent.sink.envoy_traffic()  # type: ignore[attr-defined]
        except (OSError, ValueError) as e:
            return {"ok": False, "msg": f"Envoy's stats are not readable now: {e}"}
        snap = {**figures["golden"], "envoy": figures["envoy"],
                "pods": {p.key: f"{p.namespace}/{p.workload or p.name}"
                         for p in agent.store.all()}}
        return {"ok": True, "traffic": snap, "at": time.time()}
    if command == "uninstall":  # root only: the status socket is mode 0600
        report = agent.release_all("aether-agent uninstall")
        agent.options.envoy_on_exit = "stop"
        if agent.on_exit_request is not None:  # answer first, then exit
            threading.Timer(0.3, agent.on_exit_request).start()
        return {"ok": True, "uninstall": report, "pid": os.getpid()}
    if command != "pod":
        return {"ok": False,
                "msg": 'expected "command": "status", "pod", "traffic" or "uninstall"'}
    pod, dest = request.get("pod"), request.get("dest")
    if not isinstance(pod, str) or pod.count("/") != 1:
        return {"ok": False, "msg": 'expected "pod": "<namespace>/<name>"'}
    if dest is not None and not isinstance(dest, str):
        return {"ok": False, "msg": 'expected "dest": "IP:port" (a string) or null'}
    caller, port = request.get("from"), request.get("port")
    if caller is not None and not isinstance(caller, str):
        return {"ok": False, "msg": 'expected "from": a SPIFFE ID ("" plaintext) or null'}
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        return {"ok": False, "msg": 'expected "port": 1-65535 or null'}
    return agent.pod_status(pod, dest, caller, port)
