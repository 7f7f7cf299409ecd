"""The running agent: wires source, state, CNI handler, sockets and (optionally) Envoy.

Startup reconciles before serving: captured pods whose netns is gone are dropped, drifted
tables are re-programmed from the recorded policy, and live pods are handed back to the
listener sink, so a restart never leaves a captured pod without its rules or listener.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.capture.policy import with_node_proxies
from agent.capture.rules import render_ruleset
from agent.cni import request as cni_request
from agent.cni.handler import CniHandler, ListenerSink, NullSink
from agent.cni.server import UnixJsonServer, json_handler
from agent.cni.state import CapturedPod, StateStore
from agent.common.config import NodeConfig
from agent.common.workload import workload_of
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane
from agent.netns.enter import NetnsError
from agent.netns.pin import pins_visible_to, share_pin_dir
from agent.runtime.mesh import MeshRuntime
from agent.runtime.recovery import recover_interrupted_adds
from agent.runtime.takeover import Peer
from agent.source.base import MetadataSource

if TYPE_CHECKING:  # the subsystems' types; their modules load only when started
    from agent.gamma.lease import LeaseElector
    from agent.gamma.status import StatusLoop
    from agent.meshpods.publisher import MeshPodPublisher
    from agent.node.readiness import ReadinessLoop
    from agent.node.repair import RepairLoop
    from agent.ops.metrics import Metrics, MetricsServer
    from agent.runtime.enroll import EnrollmentLoop
    from agent.slices.writer import SliceProjector

log = logging.getLogger("aether.agent")

NO_PROXY = "n/a (no proxy)"  # a pod's listener state when the agent runs without Envoy


@dataclass
class AgentOptions:
    """Everything beyond the node basics; defaults fit a standalone node."""

    manifests: str | None = None
    kubeconfig: str | None = None
    kube: bool = False  # metadata from the Kubernetes API (in-cluster when kubeconfig is None)
    mesh: bool = True
    mesh_domain: str = "aether.internal"
    trust_domain: str = "cluster.local"
    # AuthorizationPolicies in this namespace select pods mesh-wide (Istio's root namespace)
    root_namespace: str = "aether-system"
    scope_all: bool = False
    # where other nodes' pods come from: "meshpods" (their agents' MeshPod records; this
    # node's Pods only from the Pod API) or "pods" (every Pod of the cluster)
    remote_pods: str = "meshpods"
    learn_ttl: float = 600.0
    repair: str = "report"
    cni_conf_dir: str = "/etc/cni/net.d"
    cni_bin_dir: str = "/opt/cni/bin"
    daemonset_name: str = "aether-agent"
    daemonset_namespace: str = "aether-system"
    node_loops: bool = True  # readiness taint + repair (only with the Kubernetes API)
    gamma_controller_name: str = "aether.io/mesh"
    xmesh_create: bool = True  # keep an XMesh named "aether" when the CRD is installed
    envoy_on_exit: str = "auto"  # auto: keep Envoy unless stopping for good; stop; keep
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None or 0: no metrics server
    live_enrollment: bool = True  # capture/release running pods as labels change
    release_on_removal: bool = True  # our DaemonSet deleted: release every pod before exit
    # take-overs (agent.runtime.takeover): this agent's name (its control socket), the agent it
    # replaces (found at start), and how long a replaced agent's connections get after SIGTERM
    instance: str = ""
    peer: Peer | None = None
    drain_seconds: float = 30.0


class Agent:
    def __init__(
        self, node: NodeConfig, source: MetadataSource, sink: ListenerSink | None = None,
        options: AgentOptions | None = None, dataplane: CaptureDataplane | None = None,
    ) -> None:
        self.node = node
        self.source = source
        self.options = options or AgentOptions()
        self.sink: ListenerSink = sink or NullSink()
        self.mesh: MeshRuntime | None = None
        # the subsystems, each started only where its mode needs it (imported lazily)
        self.repair: RepairLoop | None = None
        self.readiness: ReadinessLoop | None = None
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.slices: SliceProjector | None = None
        self.meshpods: MeshPodPublisher | None = None
        self.gamma_lease: LeaseElector | None = None
        self.gamma_status: StatusLoop | None = None
        self.enrollment: EnrollmentLoop | None = None  # with a mesh source
        self._sources_cache: dict[str, Any] = {}  # capture listener → traffic Source
        os.makedirs(node.run_dir, mode=0o755, exist_ok=True)
        self.store = StateStore(os.path.join(node.run_dir, "pods"))
        self.handler = CniHandler(node, source, self.store, self.sink, dataplane=dataplane)
        self.dataplane = self.handler.dataplane  # reconcile acts through the handler's
        too_large = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 103, '
                                        '"msg": "request larger than 1 MiB rejected"}'))
        busy = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 11, '
                                   '"msg": "aether agent busy (too many concurrent requests): '
                                   'try again"}'))
        self._try_again = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 11, '
                                               '"msg": "aether agent handing over to its '
                                               'successor: try again"}'))
        self.cni_server = UnixJsonServer(node.cni_socket, self._cni_request, "cni",
                                         oversize_answer=too_large, busy_answer=busy)
        # take-overs: "serving", "frozen" (a successor is taking over: CNI answers try-again)
        # or "retired" (the successor serves; this agent's Envoy drains until SIGTERM)
        self.role = "serving"
        self._gate = threading.Condition()
        self._inflight = 0
        self.handover_try_again = 0  # CNI requests answered try-again during a take-over
        self._frozen_at = 0.0
        self.peer_state = ""  # the replaced agent: "draining", then "gone"
        self.sigterm_at: float | None = None
        from agent.runtime.takeover import control_socket
        self.instance = self.options.instance or f"{node.node_name}-{os.getpid()}"
        self.control_server = UnixJsonServer(control_socket(node.run_dir, self.instance),
                                             json_handler(self._control_request), "control")
        self.status_server = UnixJsonServer(
            os.path.join(node.run_dir, "status.sock"), json_handler(self._status_request), "status"
        )
        self.started_at = time.time()
        self.reconcile_report: list[str] = []
        self.pin_peer_group = ""  # "shared:N" once <run-dir>/netns is a shared mount
        self.stopped = threading.Event()
        self.started = threading.Event()  # start() done: every socket of this agent serves
        self.on_exit_request: Callable[[], None] | None = None  # `uninstall` ends the process

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.control_server.start()
        peer = self.options.peer
        if peer is not None:
            from agent.runtime.takeover import ask
            log.info("taking over from aether-agent %s pid %d (slot %s): freezing its CNI "
                     "socket", peer.version, peer.pid, peer.slot)
            ask(peer, "freeze", timeout=90.0, successor=self.instance, pid=os.getpid())
        self._share_pin_dir()
        self.store.load()  # also sweeps temp files of writes a crash interrupted
        if self.store.load_problem:
            self.reconcile_report.append(self.store.load_problem)
        if self.store.swept:
            self._note(f"removed {len(self.store.swept)} temp files of state writes a crash "
                       "interrupted")
        # ADDs a crash cut short before their record: undone (table, pin) before anything
        # else looks at netns; the ones with a record are completed by reconcile() below
        recover_interrupted_adds(self.store, self.pin_dir, self._note, self.dataplane)
        live = [p for p in self.store.all() if os.path.exists(p.netns)]
        preload = getattr(self.sink, "preload", None)
        if callable(preload):
            preload(live)
        start = getattr(self.sink, "start", None)
        if callable(start):
            start()
        self._check_envoy_sees_pins()
        self.reconcile()
        self._drop_leftover_release_tables()
        if self.options.mesh:
            self._start_mesh()
        if peer is not None:
            self._await_own_listeners()
        self.cni_server.start(replace=peer is not None)
        if self.mesh is not None and self.options.live_enrollment:
            from agent.runtime.enroll import EnrollmentLoop
            self.enrollment = EnrollmentLoop(self.handler, self.mesh.objects, self.node)
            self.enrollment.start()
        if self.options.kube and self.options.node_loops:
            self._start_node_loops()
        if peer is not None:
            # the status socket before the commit, so `aether-agent status` always finds one
            # of the two; the metrics port only once the old agent has let go of it
            self.status_server.start(replace=True)
            self._commit_takeover(peer)
        if self.options.metrics_port:
            self._start_metrics()
        # last: a status socket that answers means every endpoint of the agent is up (tests and
        # operators read /healthz right after it; it used to race the metrics server)
        if peer is None:
            self.status_server.start()
        slot = getattr(self.sink, "slot", None)
        if isinstance(slot, str):  # the next plain start adopts this slot's Envoy
            from agent.runtime.takeover import write_serving_slot
            write_serving_slot(self.node.run_dir, slot)
        self.started.set()
        log.info("aether-agent %s ready on node %s (source: %s)", __version__,
                 self.node.node_name, self.source.describe())

    # -- take-over (agent.runtime.takeover) ------------------------------------------------------
    def _cni_request(self, raw: bytes) -> bytes:
        """The CNI handler behind the hand-over gate: once a successor is taking over, each
        request is answered try-again (kubelet retries it, and the successor serves it)."""
        with self._gate:
            if self.role != "serving":
                self.handover_try_again += 1
                log.info("CNI request answered try-again: %s", "a successor is taking over"
                         if self.role == "frozen" else "the successor serves this node")
                return self._try_again
            self._inflight += 1
        try:
            return self.handler.handle_raw(raw)
        finally:
            with self._gate:
                self._inflight -= 1
                self._gate.notify_all()

    def hello(self) -> dict[str, Any]:
        """What a successor needs to run beside this agent."""
        from agent.runtime.takeover import control_socket
        sink_pid = getattr(self.sink, "pid", None)
        return {"pid": os.getpid(), "instance": self.instance, "version": __version__,
                "control": control_socket(self.node.run_dir, self.instance),
                "slot": getattr(self.sink, "slot", "envoy"),
                "envoy_pid": sink_pid if isinstance(sink_pid, int) else None,
                "proxy_cgroup": self.node.proxy_cgroup,
                "proxy_cgroup_level": self.node.proxy_cgroup_level, "role": self.role}

    def freeze(self, successor: str, successor_pid: int | None = None,
               timeout: float = 60.0) -> dict[str, Any]:
        """A successor takes over: no CNI request served from now on, the ones in flight
        finished, live enrollment stopped; thawed again if the commit never comes."""
        with self._gate:
            if self.role == "retired":
                return {"ok": False, "msg": "already retired: another agent serves"}
            self.role, self._frozen_at = "frozen", time.monotonic()
            done = self._gate.wait_for(lambda: self._inflight == 0, timeout)
        if self.enrollment is not None:
            self.enrollment.stop()
            self.enrollment = None
        log.warning("take-over by %s: CNI requests are answered try-again until it serves",
                    successor)
        threading.Thread(target=self._thaw_unless_committed,
                         args=(self._frozen_at, successor_pid), name="takeover-thaw",
                         daemon=True).start()
        if not done:
            return {"ok": False, "msg": f"requests still in flight after {timeout:.0f}s"}
        return {"ok": True}

    def _thaw_unless_committed(self, frozen_at: float, successor_pid: int | None,
                               bound: float = 300.0) -> None:
        """A successor that dies (or never commits) must not leave the node without an
        agent serving CNI: serve again."""
        from agent.runtime.takeover import wait_pid_gone
        deadline = frozen_at + bound
        while time.monotonic() < deadline:
            dead = successor_pid is not None and wait_pid_gone(successor_pid, 0.0)
            with self._gate:
                if self.role != "frozen" or self._frozen_at != frozen_at:
                    return
                if dead:
                    self.role = "serving"
                    self._gate.notify_all()
                    log.error("the successor (pid %d) died before committing its take-over: "
                              "serving CNI requests again", successor_pid)
                    return
            time.sleep(0.2)
        with self._gate:
            if self.role != "frozen" or self._frozen_at != frozen_at:
                return
            self.role = "serving"
            self._gate.notify_all()
        log.error("the successor never committed its take-over within %.0fs: serving CNI "
                  "requests again", bound)

    def thaw(self) -> dict[str, Any]:
        with self._gate:
            if self.role == "frozen":
                self.role = "serving"
            self._gate.notify_all()
        log.warning("take-over abandoned by the successor: serving CNI requests again")
        return {"ok": True}

    def commit(self) -> dict[str, Any]:
        """The successor serves every pod now: let go of the metrics port, stop listening
        (Envoy drains), stop every loop, and wait for SIGTERM. Tables, pins and records are
        the successor's: nothing here touches them again."""
        with self._gate:
            if self.role != "frozen":
                return {"ok": False, "msg": f"not frozen ({self.role})"}
            self.role = "retired"
            self._gate.notify_all()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        self.cni_server.stop()  # the path is the successor's now: left alone
        retire = getattr(self.sink, "retire", None)
        if callable(retire):
            retire()
        threading.Thread(target=self._stop_loops, args=(False,), name="retire", daemon=True
                         ).start()
        log.warning("retired: the successor serves this node; draining until SIGTERM")
        return {"ok": True}

    def drain_progress(self) -> dict[str, Any]:
        left = getattr(self.sink, "open_connections", None)
        out: dict[str, Any] = {"role": self.role, "pid": os.getpid(), "instance": self.instance,
                               "connections_left": left() if callable(left) else None,
                               "cni_try_again": self.handover_try_again}
        if self.sigterm_at is not None:
            out["seconds_left"] = round(max(0.0, self.sigterm_at + self.options.drain_seconds
                                            - time.monotonic()), 1)
        else:
            out["seconds_left"] = None  # the drain's clock starts at SIGTERM
        return out

    def _await_own_listeners(self, timeout: float = 120.0) -> None:
        """Before taking the sockets: this agent's Envoy ready, with every recorded pod's
        listener bound (beside the old Envoy's) and its Services in."""
        ids: list[str] = [str(p.container_id) for p in self.store.all()]
        deadline = time.monotonic() + timeout
        ready = getattr(self.sink, "ready", None)
        while True:
            states = self._listener_states(ids)
            waiting = [cid for cid in ids if states[cid][0] not in ("live", NO_PROXY)]
            envoy_ok = bool(ready()) if callable(ready) else True
            if envoy_ok and not waiting:
                log.info("take-over: own Envoy holds all %d pod listeners", len(ids))
                return
            if time.monotonic() > deadline:
                peer = self.options.peer
                if peer is not None:
                    from agent.runtime.takeover import ask
                    try:
                        ask(peer, "thaw", timeout=10.0)
                    except (OSError, RuntimeError, ValueError):
                        pass
                raise RuntimeError(f"take-over abandoned: after {timeout:.0f}s own Envoy "
                                   f"{'ready' if envoy_ok else 'not ready'}, {len(waiting)} "
                                   "pod listeners not live; the old agent serves on")
            time.sleep(0.1)

    def _commit_takeover(self, peer: Peer) -> None:
        from agent.runtime.takeover import ask
        ask(peer, "commit", timeout=30.0)
        self.peer_state = "draining"
        log.info("took over from pid %d: its Envoy drains; it exits on SIGTERM", peer.pid)
        threading.Thread(target=self._after_peer, args=(peer,), name="takeover-peer",
                         daemon=True).start()

    def _after_peer(self, peer: Peer) -> None:
        """Once the replaced agent's Envoy is gone, its RETURN leaves every pod's table."""
        from agent.runtime.takeover import wait_pid_gone
        while not self.stopped.is_set():
            if wait_pid_gone(peer.envoy_pid, 1.0) and wait_pid_gone(peer.pid, 0.0):
                break
        if self.stopped.is_set():
            return
        self.peer_state = "gone"
        # the held cgroup fd stays open: an ADD rendered a moment ago may still name it
        self.node.peer_proxy.set(None)
        log.info("the replaced agent (pid %d) and its Envoy are gone: its RETURN leaves the "
                 "pod tables", peer.pid)
        self.reprogram_all()

    def reprogram_all(self) -> None:
        """Every recorded pod's table with this agent's proxy cgroups (no-op where equal).

        CNI requests are served meanwhile: each pod is re-programmed under its CNI lock and
        only if still recorded, so a pod deleted after the snapshot is not brought back."""
        from agent.capture.policy import with_node_proxies
        for pod in self.store.all():
            self.handler.update_policy(pod.container_id,
                                       lambda policy: with_node_proxies(policy, self.node))

    def _control_request(self, request: Any) -> dict[str, Any]:
        """This agent's own socket (``<run-dir>/agents/<instance>.sock``): a successor's
        hand-over, and what is asked of this agent rather than of whoever serves."""
        if not isinstance(request, dict):
            return {"ok": False, "msg": "expected a JSON object"}
        command = request.get("command")
        if command == "hello":
            return {"ok": True, "hello": self.hello()}
        if command == "freeze":
            pid = request.get("pid")
            return self.freeze(str(request.get("successor") or "?"),
                               pid if isinstance(pid, int) else None)
        if command == "thaw":
            return self.thaw()
        if command == "commit":
            return self.commit()
        if command == "drain":
            return {"ok": True, "drain": self.drain_progress()}
        if command == "ready":
            failing = [k for k, ok in self.readiness_checks().items() if not ok]
            if self.role != "serving":
                failing.append(self.role)
            return {"ok": True, "ready": not failing, "failing": failing, "role": self.role}
        return self._status_request(request)

    @property
    def pin_dir(self) -> str:
        return os.path.join(self.node.run_dir, "netns")

    def _share_pin_dir(self) -> None:
        """<run-dir>/netns as a shared bind mount of itself (as `ip netns` makes
        /var/run/netns): pins made later by this or any later agent propagate to every mount
        namespace in its peer group — an adopted Envoy's included."""
        try:
            self.pin_peer_group = share_pin_dir(self.pin_dir) or "?"
            log.info("pin directory %s: shared bind mount (%s)", self.pin_dir, self.pin_peer_group)
        except OSError as e:
            self.pin_peer_group = ""
            self._note(f"pin directory {self.pin_dir} could not be made a shared mount ({e}): "
                       "pins of /proc/<pid>/ns/net paths stay in this agent's mount namespace")

    def envoy_sees_pins(self) -> bool | None:
        """Whether pins made now reach Envoy's mount namespace (None: no Envoy, unknown).
        Asked of Envoy's keeper (its parent, in its mount namespace) by its pid file."""
        pid_path = getattr(self.sink, "pid_path", None)
        if not isinstance(pid_path, str):
            return None
        try:
            with open(pid_path) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pins_visible_to(pid, self.pin_dir)

    def _check_envoy_sees_pins(self) -> None:
        """An Envoy adopted from a mount namespace that does not receive our pins (a systemd
        unit's sandbox is a slave copy, made anew at each start) could never open the pins of
        `/proc/<pid>/ns/net` paths: restart it in ours, once, before serving ADDs. Captured
        pods' connections are refused (never bypassing) for the seconds that takes."""
        if self.envoy_sees_pins() is not False:
            return
        why = (f"it lives in a mount namespace that does not receive mounts under "
               f"{self.pin_dir}, so it could not open the pins of /proc netns paths")
        restart = getattr(self.sink, "restart_adopted", None)
        if callable(restart) and restart(why):
            self._note(f"restarted the adopted Envoy: {why}")
            return
        self._note(f"Envoy (adopted) lives in another mount namespace that does not receive "
                   f"mounts under {self.pin_dir}: ADDs with /proc/<pid>/ns/net netns paths "
                   "fail until Envoy restarts")

    def _start_mesh(self) -> None:
        o = self.options
        self.mesh = MeshRuntime(self.node, mesh_domain=o.mesh_domain, trust_domain=o.trust_domain,
                                scope_all=o.scope_all, learn_ttl=o.learn_ttl,
                                controller_name=o.gamma_controller_name,
                                root_namespace=o.root_namespace)
        watcher: Any = None
        if o.manifests:
            from agent.source.cached import CachedSource
            from agent.source.watch import ManifestWatcher
            watcher = ManifestWatcher(o.manifests, self.mesh.objects)
            # ADD reads what the watcher already holds; a pod it has not seen yet (written a
            # moment ago) falls through to a fresh directory read
            self.source = CachedSource(self.source, self.mesh.objects)
            self.handler.source = self.source
        elif o.kube:
            from agent.source.cached import CachedSource
            from agent.source.watch import (
                MESH_KINDS,
                MESH_KINDS_RECORDS,
                KubeWatcher,
                node_pods_selector,
            )
            every_pod = o.remote_pods == "pods"
            watcher = KubeWatcher(
                o.kubeconfig, MESH_KINDS if every_pod else MESH_KINDS_RECORDS,
                self.node.node_name, self.mesh.objects,
                field_selectors=None if every_pod else node_pods_selector(self.node.node_name))
            # ADD answers from the watch cache, so API trouble does not stall pod starts
            self.source = CachedSource(self.source, self.mesh.objects)
            self.handler.source = self.source
        for pod in self.store.all():
            self.mesh.model.register_local(pod.uid, pod.namespace, pod.name, pod.service_account,
                                           pod.ips, ready=True)
        if hasattr(self.sink, "authz_for"):
            # an ADD's first listener already enforces the policies selecting the pod
            self.sink.authz_for = self.mesh.authz.for_pod
        authz = self.mesh.authz
        self.node.authz.set(lambda ns, labels: bool(authz.for_pod(ns, labels)))
        self.mesh.on_authz_selection = self._judge_selected
        self.mesh.on_policy_problem = self._policy_problem
        self.handler.on_captured = self.mesh.pod_captured
        self.handler.on_released = self.mesh.pod_released
        set_learner = getattr(self.sink, "set_access_callback", None)
        if callable(set_learner):
            set_learner(self.mesh.learned)
        sink = self.sink if callable(getattr(self.sink, "set_services", None)) else None
        self.mesh.start(watcher, sink)  # type: ignore[arg-type]
        if o.kube:
            from agent.kube import api_client
            from agent.meshpods.publisher import MeshPodPublisher, MeshPodWriter
            from agent.slices.writer import SliceProjector, SliceWriter
            synced = watcher.wait_synced if watcher is not None else None
            self.slices = SliceProjector.for_mesh(
                self.mesh.objects, self.mesh.model,
                SliceWriter(api_client(o.kubeconfig), self.node.node_name))
            self.meshpods = MeshPodPublisher.for_mesh(
                self.mesh.objects, self.mesh.model,
                MeshPodWriter(api_client(o.kubeconfig), self.node.node_name))
            self.mesh.followers += [self.slices, self.meshpods]
            self.slices.start(synced=synced)
            self.meshpods.start(synced=synced)
            self._start_route_status(watcher)

    def _policy_problem(self, namespace: str, name: str, uid: str, why: str) -> None:
        """An AuthorizationPolicy that cannot be read: a Warning Event on it (it is enforced
        fail closed meanwhile)."""
        from agent.authz.policy import API_VERSION, KIND
        from agent.source.base import PodEvent
        self.handler.events.put(PodEvent(
            namespace, name, uid, "InvalidAuthorizationPolicy",
            f"cannot be read ({why}); enforced fail closed until it is fixed",
            kind=KIND, api_version=API_VERSION))

    def _judge_selected(self, selected: frozenset[str]) -> None:
        """The pods an AuthorizationPolicy selects changed: their rules steer plaintext
        inbound to the proxy to be judged (PERMISSIVE ones), the others' stop doing so."""
        from agent.capture.policy import CapturePolicy, with_judged
        node = self.handler.strict_node()
        for rec in self.store.all():
            want = rec.key in selected and not rec.policy.strict
            if rec.policy.judged != want:
                def change(p: CapturePolicy, w: bool = want) -> CapturePolicy:
                    return with_judged(p, w, node)
                self.handler.update_policy(
                    rec.container_id, change,
                    reason=("an authorization policy selects it: plaintext inbound judged"
                            if want else None))

    def readiness_checks(self) -> dict[str, bool]:
        """What /readyz and the node taint wait for: plugin installed, socket served, Envoy."""
        from agent.node.readiness import plugin_installed, socket_serving
        o = self.options
        ready = getattr(self.sink, "ready", None)
        checks = {
            "socket": socket_serving(self.node.cni_socket),
            "envoy": bool(ready()) if callable(ready) else True,
        }
        if o.kube:
            checks["plugin"] = plugin_installed(o.cni_conf_dir, o.cni_bin_dir)
        if self.role != "serving" or not self.started.is_set():
            # starting (a take-over not yet committed), frozen or retired: not this agent's
            # node to serve (yet, or any more)
            checks["serving"] = False
        return checks

    def _repairs(self) -> float:
        """Uncaptured managed pods acted on (reported or evicted) by the repair loop."""
        return float(len(self.repair.found)) if self.repair is not None else 0.0

    def _traffic_source(self, listener: str) -> Any:
        """``capture-<container id>`` → the calling pod's namespace, workload and name (for
        the traffic metrics; a gRPC thread, so dict reads and a small cache only)."""
        from agent.envoy.resources import LISTENER_PREFIX
        from agent.envoy.traffic import Source
        cached = self._sources_cache.get(listener)
        if cached is not None:
            return cached
        pod = self.store.get(listener[len(LISTENER_PREFIX):]) \
            if listener.startswith(LISTENER_PREFIX) else None
        if pod is None:
            return None
        obj = self.mesh.objects.get("Pod", pod.namespace, pod.name) if self.mesh else None
        src = Source(pod.namespace, workload_of(pod.name, obj), pod.name)
        if len(self._sources_cache) > 10_000:
            self._sources_cache.clear()
        self._sources_cache[listener] = src
        return src

    def _dependency_set_size(self) -> float:
        return float(len(self.mesh.model.in_scope_keys())) if self.mesh is not None else 0.0

    def _start_metrics(self) -> None:
        from agent.ops.metrics import Metrics, MetricsServer
        m = Metrics()
        self.metrics = m
        self.handler.metrics = m
        sink: Any = self.sink
        if hasattr(sink, "metrics"):
            sink.metrics = m
        ident = getattr(sink, "identity", None)
        if ident is not None:
            m.identity_source = ident.status
            xds = getattr(sink, "xds", None)
            if xds is not None:
                m.mesh_traffic_source = xds.inbound.status
        xds = getattr(sink, "xds", None)
        if xds is not None and xds.access_records is not None:
            xds.access_records.resolve = self._traffic_source
        if hasattr(sink, "envoy_traffic"):
            m.traffic_source = sink.golden_traffic
            m.envoy_traffic_source = sink.envoy_figures
        m.set_sources(
            pods_captured=lambda: float(len(self.store.all())),
            annotation_errors=lambda: float(self.handler.counters.annotation_errors),
            dependency_set_size=self._dependency_set_size if self.mesh is not None else None,
            cni_repairs=self._repairs if self.options.kube else None,
            envoy_restarts=(lambda: float(sink.supervisor.restarts))
            if hasattr(sink, "supervisor") else None,
            envoy_ready=(lambda: float(bool(sink.ready()))) if hasattr(sink, "ready") else None,
            xds_nacks=(lambda: float(sink.xds.status().get("nack_count") or 0))
            if hasattr(sink, "xds") else None,
        )

        def ready() -> tuple[bool, str]:
            failing = [k for k, ok in self.readiness_checks().items() if not ok]
            return not failing, ", ".join(failing) or "ready"

        # a take-over binds the port its predecessor has just let go of: a moment's retry
        deadline = time.monotonic() + (10.0 if self.options.peer is not None else 0.0)
        while True:
            try:
                self.metrics_server = MetricsServer(
                    m, self.options.metrics_host, self.options.metrics_port or 0,
                    live=lambda: not self.stopped.is_set(), ready=ready)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.metrics_server.start()
        log.info("metrics on %s:%d (/metrics /healthz /readyz)", self.metrics_server.host,
                 self.metrics_server.port)

    def _start_route_status(self, watcher: Any) -> None:
        """GAMMA route status: one writer cluster-wide (Lease), every agent routes."""
        from agent.gamma.lease import LeaseElector
        from agent.gamma.status import StatusLoop, StatusWriter
        from agent.gamma.xmesh import XMeshPublisher
        from agent.kube import api_client

        assert self.mesh is not None
        o = self.options
        gapi, ctrl, objects = api_client(o.kubeconfig), o.gamma_controller_name, self.mesh.objects
        self.gamma_lease = LeaseElector(gapi, self.node.node_name, namespace=o.daemonset_namespace)
        mesh = self.mesh

        self.gamma_status = StatusLoop(
            mesh.route_statuses, StatusWriter(gapi, ctrl, self.gamma_lease),
            xmesh=XMeshPublisher(gapi, ctrl, self.node.node_name, lease=self.gamma_lease,
                                 create_missing=o.xmesh_create))
        status_loop = self.gamma_status
        self.gamma_lease.on_change = lambda _l: status_loop.mark_dirty()
        kinds = ("HTTPRoute", "GRPCRoute", "Service", "Namespace")
        objects.on_event(lambda ev: status_loop.mark_dirty() if ev.kind in kinds else None,
                         replay=False)
        self.gamma_lease.start()
        self.gamma_status.start(synced=watcher.wait_synced if watcher is not None else None)

    def _start_node_loops(self) -> None:
        from agent.kube import api_client
        from agent.node.readiness import (
            NodeReadiness,
            ReadinessLoop,
            plugin_installed,
            socket_serving,
        )
        from agent.node.repair import RepairLoop

        o = self.options
        api = api_client(o.kubeconfig)
        self.repair = RepairLoop(api, self.node, lambda: {p.uid for p in self.store.all()},
                                 self.source.record_event, mode=o.repair)
        self.repair.start()
        envoy_ready = getattr(self.sink, "ready", None)
        self.readiness = ReadinessLoop(NodeReadiness(api, self.node.node_name), {
            "plugin": lambda: plugin_installed(o.cni_conf_dir, o.cni_bin_dir),
            "socket": lambda: socket_serving(self.node.cni_socket),
            "envoy": envoy_ready if callable(envoy_ready) else (lambda: True),
        })
        self.readiness.start()

    def stop(self) -> None:
        self.sigterm_at = time.monotonic()
        with self._gate:  # a take-over under way: SIGTERM waits for its outcome
            self._gate.wait_for(lambda: self.role != "frozen", 60.0)
        if self.role == "retired":
            self._finish_drain()
            return
        o = self.options
        for_good = True
        if o.kube:
            from agent.node.readiness import shutting_down_for_good
            for_good = shutting_down_for_good(o.kubeconfig, o.daemonset_namespace, o.daemonset_name)
        if self.enrollment is not None:
            self.enrollment.stop()
        if self.repair is not None:
            self.repair.stop()
        # only our DaemonSet seen gone or deleting counts (no DaemonSet name: never)
        if o.kube and o.daemonset_name and for_good and o.release_on_removal:
            self._release_on_removal()
        self._stop_loops(for_good)
        # An agent restart or upgrade leaves Envoy serving its last config (the next agent
        # adopts it); a stop for good (our DaemonSet gone, or a standalone stop) stops it.
        keep = o.envoy_on_exit == "keep" or (o.envoy_on_exit == "auto" and not for_good)
        stop = getattr(self.sink, "stop", None)
        if callable(stop):
            if keep:
                stop(keep_envoy=True)
            else:
                stop()
        self.control_server.stop()
        self.stopped.set()

    def _stop_loops(self, for_good: bool) -> None:
        """Everything but the Envoy: loops, watchers, servers (a retiring agent's too)."""
        if self.enrollment is not None:
            self.enrollment.stop()
            self.enrollment = None
        if self.repair is not None:
            self.repair.stop()
        if self.readiness is not None:
            self.readiness.stop(for_good=for_good)
        if self.slices is not None:
            self.slices.stop(node_leaving=for_good)
        if self.meshpods is not None:
            self.meshpods.stop(node_leaving=for_good)
        if self.gamma_status is not None:
            self.gamma_status.stop()
        if self.gamma_lease is not None:
            self.gamma_lease.stop(release=True)
        if self.mesh is not None:
            self.mesh.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        self.cni_server.stop()  # each path is removed only while it is still this agent's
        self.status_server.stop()

    def _finish_drain(self) -> None:
        """SIGTERM of a retired agent: its Envoy's remaining connections get
        ``--drain-seconds`` (less if they end sooner), then it stops, and nothing else."""
        deadline = time.monotonic() + self.options.drain_seconds
        count = getattr(self.sink, "open_connections", None)
        left = count() if callable(count) else None
        log.info("SIGTERM while retired: %s connections left, draining for up to %.0fs",
                 "?" if left is None else left, self.options.drain_seconds)
        while time.monotonic() < deadline:
            left = count() if callable(count) else None
            if left == 0:
                break
            time.sleep(0.2)
        stop = getattr(self.sink, "stop", None)
        if callable(stop):
            stop()
        log.info("retired agent exits (%s connections were left at the end of the drain)",
                 "?" if left is None else left)
        self.control_server.stop()
        self.stopped.set()

    def _release_on_removal(self, wait_s: float = 30.0) -> None:
        """Our DaemonSet is being deleted: once `cni-install` has taken aether-cni out of the
        CNI config (so no new pod is captured), release every pod; an upgrade never gets
        here (the DaemonSet is still there)."""
        from agent.node.readiness import plugin_installed
        o = self.options
        deadline = time.monotonic() + wait_s
        while plugin_installed(o.cni_conf_dir, o.cni_bin_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        if plugin_installed(o.cni_conf_dir, o.cni_bin_dir):
            log.error("our DaemonSet is being deleted but aether-cni is still in the CNI config "
                      "after %.0fs: releasing the pods anyway (new pods fail ADD until the "
                      "entry goes)", wait_s)
        self.release_all("our DaemonSet is being deleted")

    def release_all(self, why: str) -> dict[str, Any]:
        """Release every captured pod (uninstall, or our DaemonSet deleted): no new capture
        from here on, each pod's table then its listener, and nothing remembered."""
        self.handler.uninstalling = True
        if self.enrollment is not None:
            self.enrollment.stop()
            self.enrollment = None
        records = sorted(self.store.all(), key=lambda r: r.key)
        log.warning("%s: releasing all %d captured pods; their traffic flows directly from "
                    "now on", why, len(records))
        released: list[str] = []
        failed: list[str] = []
        for i, rec in enumerate(records, 1):
            ok = self.handler.release(rec.container_id, why, remember=False)
            (released if ok else failed).append(rec.key)
            log.info("[%d/%d] %s %s", i, len(records), rec.key, "released" if ok else "FAILED")
        for seen in self.store.all_seen():
            self.store.remove_seen(seen.container_id)
        self.handler.finish_releases(wait=True)  # Envoy closed their connections: tables go
        failed += [r.key for r in self.store.all()]  # a release that could not drop its table
        return {"released": released, "failed": failed}

    def reconcile(self) -> None:
        """Bring recorded pods back to their recorded capture (or forget them if dead)."""
        for pod in self.store.all():
            gone = self._pod_gone(pod)
            if gone:
                self._note(f"{pod.key}: netns {pod.kubelet_netns} gone ({gone}); dropped from state")
                if pod.pinned:
                    try:
                        self.dataplane.unpin(pod.netns)
                    except OSError as err:
                        self._note(f"{pod.key}: unpin failed: {err}")
                try:
                    self.sink.remove_pod(pod)
                except Exception as err:  # noqa: BLE001
                    self._note(f"{pod.key}: listener removal failed: {err}")
                self.store.remove(pod.container_id)
                continue
            try:
                live = self.dataplane.live_fingerprint(pod.netns)
                # this agent's proxy cgroup (and a take-over peer's) in place of the writer's
                want = with_node_proxies(pod.policy, self.node)
                drifted, moved = live != pod.fingerprint, want != pod.policy
                if drifted or moved:
                    pod.fingerprint = self.dataplane.apply(pod.netns, render_ruleset(want))
                    pod.policy = want
                    self.store.put(pod)
                    if drifted:
                        self._note(f"{pod.key}: capture table "
                                   f"{'missing' if live is None else 'drifted'}; re-programmed")
                    else:
                        log.info("%s: table re-programmed for this agent's proxy cgroup(s)",
                                 pod.key)
            except DATAPLANE_ERRORS as e:
                self._note(f"{pod.key}: re-programming failed: {e}")
            try:
                restore = getattr(self.sink, "restore_pod", self.sink.add_pod)
                restore(pod)
            except Exception as e:  # noqa: BLE001
                self._note(f"{pod.key}: listener not restored: {e}")
        log.info("reconciled %d captured pods", len(self.store.all()))

    def _drop_leftover_release_tables(self) -> None:
        """A pod released live keeps an empty table for a few seconds; an agent that died in
        them left it behind. An uncaptured pod never holds one: drop it."""
        for seen in self.store.all_seen():
            try:
                if list(self.dataplane.identity(seen.kubelet_netns)) != list(seen.netns_id):
                    continue
                if self.dataplane.listing(seen.kubelet_netns) is not None:
                    self.dataplane.drop(seen.kubelet_netns)
                    self._note(f"{seen.key}: dropped the table left from its release")
            except DATAPLANE_ERRORS as e:
                self._note(f"{seen.key}: checking for a table left from its release: {e}")

    def _pod_gone(self, pod: CapturedPod) -> str:
        """Why the pod's sandbox is gone ('' if it lives). A pin keeps its netns alive, so a
        pinned pod is judged by kubelet's own path (/proc/<pid>/ns/net: the sandbox process);
        a lost pin (e.g. the agent's mounts did not survive) is re-made when that path still
        holds the netns with our table in it."""
        if not pod.pinned:
            try:
                self.dataplane.check_netns(pod.netns)
                return ""
            except NetnsError as e:
                return str(e)
        try:
            self.dataplane.check_netns(pod.kubelet_netns)
        except NetnsError as e:
            return f"sandbox process gone: {e}"
        if self.dataplane.netns_state(pod.netns) == "netns":  # the pin holds
            same = self.dataplane.identity(pod.netns) == self.dataplane.identity(
                pod.kubelet_netns)
            return "" if same else "the sandbox pid now belongs to another netns"
        try:
            live = self.dataplane.live_fingerprint(pod.kubelet_netns)
        except DATAPLANE_ERRORS as e:
            return f"pin lost and netns unreadable: {e}"
        if live is None:
            return "pin lost and the kubelet path holds no aether table"
        try:
            self.dataplane.pin(pod.kubelet_netns, pod.netns)
        except OSError as e:
            return f"pin lost and could not be re-made: {e}"
        self._note(f"{pod.key}: netns pin was lost; re-pinned from {pod.kubelet_netns}")
        return ""

    def _note(self, msg: str) -> None:
        log.warning("reconcile: %s", msg)
        self.reconcile_report.append(msg)

    # -- status --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        c = self.handler.counters
        pods = []
        records = sorted(self.store.all(), key=lambda x: x.key)
        listeners = self._listener_states([p.container_id for p in records])
        for pod in records:
            try:
                live = self.dataplane.live_fingerprint(pod.netns)
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
        out: dict[str, Any] = {
            "version": __version__,
            "node": self.node.node_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "source": self.source.describe(),
            "run_dir": self.node.run_dir,
            "counters": vars(c).copy(),
            "pods": pods,
            "warnings": list(self.handler.recent_problems) + [
                {"pod": p["pod"], "reason": "NetAdminPod",
                 "message": "holds NET_ADMIN (or is privileged): it could set the passthrough "
                            "mark on its own sockets and bypass capture"}
                for p in pods if p["net_admin"]],
            "reconcile": list(self.reconcile_report),
            # running pods ADD left uncaptured, watched for a label/annotation that captures them
            "live_enrollment": {
                "enabled": self.enrollment is not None,
                "watched_uncaptured": len(self.store.all_seen()),
                "passes": self.enrollment.passes if self.enrollment is not None else 0,
                "discovered": self.enrollment.discovered if self.enrollment is not None else 0,
                # to be captured, started before aether, netns not found by IP (yet)
                "not_found": sorted(self.enrollment.not_found.values())
                if self.enrollment is not None else [],
            },
            "pin_dir": {"path": self.pin_dir, "propagation": self.pin_peer_group or "private",
                        "envoy_sees_pins": self.envoy_sees_pins()},
            "source_problems": self._source_problems(),
            "refused_busy": {"cni": self.cni_server.refused, "status": self.status_server.refused},
            "events": self.handler.events.status(),
            "capture_integrity": {
                "proxy_match": (f'mark + socket cgroupv2 level {self.node.proxy_cgroup_level} '
                                f'"{self.node.proxy_cgroup}"' if self.node.proxy_cgroup
                                else "mark only"),
                "problem": self.node.proxy_cgroup_problem,
                "cgroup": self.node.proxy_cgroup,
                "level": self.node.proxy_cgroup_level,
            },
        }
        out["takeover"] = self.takeover_state()
        out["cni_install"] = self.cni_install_state()
        if self.mesh is not None:
            out["mesh"] = self.mesh.status()
        if self.repair is not None:
            out["capture_missing"] = self.repair.status()
        if self.readiness is not None:
            out["readiness"] = self.readiness.status()
        if self.slices is not None:
            out["endpoint_slices"] = self.slices.status()
        if self.meshpods is not None:
            out["meshpods"] = {**self.meshpods.status(), "remote_pods": self.options.remote_pods}
        if self.gamma_status is not None:
            out["route_status"] = self.gamma_status.status()
        extra = getattr(self.sink, "status", None)
        if callable(extra):
            out["envoy"] = extra()
        out["degraded"] = bool(self.node.proxy_cgroup_problem) or any(
            p["rules"] != "ok" or p["listener"] not in ("live", NO_PROXY) for p in pods) or bool(
            out.get("envoy", {}).get("degraded")
        )
        return out

    def takeover_state(self) -> dict[str, Any]:
        """Which agent serves, and the one being replaced with its drain progress."""
        out: dict[str, Any] = {"role": self.role, "instance": self.instance, "pid": os.getpid(),
                               "slot": getattr(self.sink, "slot", None),
                               "cni_try_again": self.handover_try_again}
        peer = self.options.peer
        if peer is None:
            return out
        replaced: dict[str, Any] = {"pid": peer.pid, "instance": peer.instance,
                                    "version": peer.version, "slot": peer.slot,
                                    "state": self.peer_state or "taking over"}
        if self.peer_state == "draining":
            from agent.runtime.takeover import ask
            try:
                replaced.update(ask(peer, "drain", timeout=1.0)["drain"])
                replaced["state"] = "draining"
            except (OSError, RuntimeError, ValueError) as e:
                replaced["drain_error"] = str(e)
        out["replaced"] = replaced
        return out

    def _source_problems(self) -> list[str]:
        """What the metadata source cannot use (e.g. a manifest that fails to parse and is
        served from its last good version), from the CNI lookups' source and the watcher."""
        holders: list[Any] = [self.source, getattr(self.source, "inner", None)]
        if self.mesh is not None:
            holders.append(getattr(self.mesh, "watcher", None))
        seen: list[str] = []
        for holder in holders:
            for problem in getattr(holder, "problems", None) or []:
                if str(problem) not in seen:
                    seen.append(str(problem))
        return seen

    def _listener_states(self, container_ids: list[str]) -> dict[str, tuple[str, str]]:
        """(state, detail) of each pod's listener as the proxy holds it — never the agent's
        intent: a NACKed, draining or stopped listener is not live. Only "live" is healthy."""
        ask = getattr(self.sink, "listener_states", None)
        if not callable(ask):
            return {cid: (NO_PROXY, "") for cid in container_ids}
        try:
            states = ask(container_ids)
            return {cid: (states[cid].state, states[cid].detail) for cid in container_ids}
        except Exception as e:  # noqa: BLE001 - status must answer whatever the proxy does
            log.exception("reading the proxy's listeners failed")
            return {cid: ("unknown", f"reading the proxy's listeners failed: {e}")
                    for cid in container_ids}

    def cni_install_state(self) -> dict[str, Any]:
        """Which conflist kubelet uses, whether our entry and binary are there, last repair."""
        from agent.install import conflist as cl
        from agent.install.installer import read_configs
        o = self.options
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
            with open(os.path.join(self.node.run_dir, "cni-install.json")) as f:
                watcher = json.load(f)
            out["repairs"] = watcher.get("repairs")
            out["last_repair"] = watcher.get("last_repair")
        except (OSError, ValueError):
            out["repairs"] = None
        return out

    def _pod_authz(self, pod: CapturedPod, caller: str | None, port: int | None
                   ) -> dict[str, Any]:
        """The AuthorizationPolicies its inbound listener enforces and, for ``caller`` (a
        SPIFFE ID; "" a plaintext caller), the decision at L4 on ``port``."""
        from agent.authz.policy import Request, decide, describe
        authz_of = getattr(self.sink, "authz_of", None)
        policies = authz_of(pod.container_id) if callable(authz_of) else ()
        out: dict[str, Any] = {"policies": describe(policies),
                               "plaintext_judged": pod.policy.judged}
        if caller is not None:
            d = decide(policies, Request(port=port or 0, principal=caller or None))
            out["from"] = {"caller": caller or "(plaintext)", "port": port,
                           "allowed": d.allowed, "reason": d.reason,
                           "audited": list(d.audited)}
        return out

    def pod_status(self, key: str, dest: str | None, caller: str | None = None,
                   port: int | None = None) -> dict[str, Any]:
        """One pod in depth: rules as programmed, its listener, where dest would go and,
        with ``caller``, what its AuthorizationPolicies decide for that caller."""
        pods = [p for p in self.store.all() if p.key == key]
        if not pods:
            return {"ok": False, "msg": f"pod {key} is not captured on this node"}
        pod = pods[0]
        out: dict[str, Any] = {"pod": key, "container_id": pod.container_id, "netns": pod.netns,
                               "mode": pod.policy.mode, "reason": pod.reason, "ips": pod.ips,
                               "problems": [str(x) for x in pod.problems]}
        try:
            out["rules"] = self.dataplane.listing(pod.netns)
            live = self.dataplane.live_fingerprint(pod.netns)
            out["rules_verified"] = "ok" if live == pod.fingerprint else "drift"
        except DATAPLANE_ERRORS as e:
            out["rules"], out["rules_verified"] = None, f"error: {e}"
        out["listener"] = f"capture-{pod.container_id}"
        state, detail = self._listener_states([pod.container_id])[pod.container_id]
        out["listener_state"], out["listener_detail"] = state, detail
        out["listener_live"] = None if state in (NO_PROXY, "unknown") else state == "live"
        out["degraded"] = out["rules_verified"] != "ok" or state not in ("live", NO_PROXY)
        out["authorization"] = self._pod_authz(pod, caller, port)
        if dest:
            from agent.capture.explain import explain_destination
            host, _, dport = dest.rpartition(":")
            host = host.strip("[]")
            services: dict[tuple[str, int], str] = {}
            if self.mesh is not None:
                for view in self.mesh.model.in_scope_services():
                    for ip in view.cluster_ips:
                        for sp in view.ports:
                            services[(ip, sp.port)] = view.key
            try:
                out["dest"] = {"address": dest, "verdict": explain_destination(
                    pod.policy, pod.ips, host, int(dport), services)}
            except ValueError:
                out["dest"] = {"address": dest, "verdict": "expected IP:port"}
        return {"ok": True, "pod": out}

    def _status_request(self, request: Any) -> dict[str, Any]:
        """`{"command": "status"}` or `{"command": "pod", "pod": "<ns>/<name>", "dest":
        "IP:port" | null}`; anything else is answered with what was expected."""
        if not isinstance(request, dict):
            return {"ok": False, "msg": "expected a JSON object"}
        command = request.get("command")
        if command == "status":
            return {"ok": True, "status": self.status()}
        if command == "hello":  # a successor starting on this run dir (agent.runtime.takeover)
            return {"ok": True, "hello": self.hello()}
        if command == "traffic":  # aether-agent top
            xds = getattr(self.sink, "xds", None)
            if xds is None:
                return {"ok": False, "msg": "no Envoy on this node: no traffic metrics"}
            try:  # the golden metrics and Envoy's own figures, from Envoy's stats
                figures = self.sink.envoy_traffic()  # type: ignore[attr-defined]
            except (OSError, ValueError) as e:
                return {"ok": False, "msg": f"Envoy's stats are not readable now: {e}"}
            snap = {**figures["golden"], "envoy": figures["envoy"],
                    "pods": {p.key: f"{p.namespace}/{p.workload or p.name}"
                             for p in self.store.all()}}
            return {"ok": True, "traffic": snap, "at": time.time()}
        if command == "uninstall":  # root only: the status socket is mode 0600
            report = self.release_all("aether-agent uninstall")
            self.options.envoy_on_exit = "stop"
            if self.on_exit_request is not None:  # answer first, then exit
                threading.Timer(0.3, self.on_exit_request).start()
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
        return self.pod_status(pod, dest, caller, port)
