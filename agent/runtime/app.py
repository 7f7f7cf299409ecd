"""The running agent: wires source, state, CNI handler, sockets and (optionally) Envoy.

Startup reconciles before serving: captured pods whose netns is gone are dropped, drifted
tables are re-programmed from the recorded policy, and live pods are handed back to the
listener sink, so a restart never leaves a captured pod without its rules or listener.

This module is the composition and the lifecycle; the parts it wires live beside it: the
options (``options``), the status document (``status_doc``), the take-over handshake
(``handover``), readiness and metrics (``probes``), the Kubernetes API loops
(``kube_loops``), and reconcile and release (``reconcile``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.cni import request as cni_request
from agent.cni.handler import CniHandler, ListenerSink, NullSink
from agent.cni.server import UnixJsonServer, json_handler
from agent.cni.state import StateStore
from agent.common.config import NodeConfig
from agent.netns.dataplane import CaptureDataplane
from agent.netns.pin import pins_visible_to, share_pin_dir
from agent.runtime import handover, kube_loops, probes, status_doc
from agent.runtime import reconcile as recorded
from agent.runtime.mesh import MeshRuntime
from agent.runtime.options import AgentOptions
from agent.runtime.recovery import recover_interrupted_adds
from agent.runtime.status_doc import NO_PROXY
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

__all__ = ["NO_PROXY", "Agent", "AgentOptions"]

log = logging.getLogger("aether.agent")


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
        os.makedirs(node.run_dir, mode=0o755, exist_ok=True)
        self.store = StateStore(os.path.join(node.run_dir, "pods"))
        self.handler = CniHandler(node, source, self.store, self.sink, dataplane=dataplane)
        self.dataplane = self.handler.dataplane  # reconcile acts through the handler's
        self.gate = handover.HandoverGate()  # take-overs (agent.runtime.handover)
        too_large = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 103, '
                                        '"msg": "request larger than 1 MiB rejected"}'))
        busy = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 11, '
                                   '"msg": "aether agent busy (too many concurrent requests): '
                                   'try again"}'))
        self.cni_server = UnixJsonServer(node.cni_socket, self._cni_request, "cni",
                                         oversize_answer=too_large, busy_answer=busy)
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
        restored = getattr(self.sink, "restored", None)
        if callable(restored):  # every recorded pod served again (the pod DNS's hand-over)
            restored()
        self._drop_leftover_release_tables()
        if self.options.mesh:
            self._start_mesh()
        if peer is not None:
            handover.await_own_listeners(self.sink, [str(p.container_id) for p in self.store.all()],
                                         peer)
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
            handover.commit_takeover(self.gate, peer, self.node, self.stopped, self.reprogram_all)
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

    # -- take-over (agent.runtime.takeover, agent.runtime.handover) -------------------------------
    @property
    def role(self) -> str:
        """The take-over role: "serving", "frozen" (a successor is taking over: CNI answers
        try-again) or "retired" (the successor serves; this agent's Envoy drains until SIGTERM)."""
        return self.gate.role

    def _cni_request(self, raw: bytes) -> bytes:
        """The CNI handler behind the hand-over gate: once a successor is taking over, each
        request is answered try-again (kubelet retries it, and the successor serves it)."""
        return self.gate.serve(self.handler.handle_raw, raw)

    def hello(self) -> dict[str, Any]:
        """What a successor needs to run beside this agent."""
        return handover.hello(self.node, self.sink, self.instance, self.role)

    def freeze(self, successor: str, successor_pid: int | None = None,
               timeout: float = 60.0) -> dict[str, Any]:
        """A successor takes over: no CNI request served from now on, the ones in flight
        finished, live enrollment stopped; thawed again if the commit never comes."""
        return self.gate.freeze(successor, successor_pid, timeout, self._stop_enrollment)

    def thaw(self) -> dict[str, Any]:
        return self.gate.thaw()

    def commit(self) -> dict[str, Any]:
        """The successor serves every pod now: let go of the metrics port, stop listening
        (Envoy drains), stop every loop, and wait for SIGTERM. Tables, pins and records are
        the successor's: nothing here touches them again."""
        return self.gate.commit(self._retire)

    def _retire(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        self.cni_server.stop()  # the path is the successor's now: left alone
        retire = getattr(self.sink, "retire", None)
        if callable(retire):
            retire()
        threading.Thread(target=self._stop_loops, args=(False,), name="retire", daemon=True
                         ).start()

    def drain_progress(self) -> dict[str, Any]:
        return self.gate.drain_progress(self.sink, self.instance, self.options.drain_seconds)

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
        return handover.control_request(self, request, self._status_request)

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
        dns = getattr(self.sink, "dns", None)
        if dns is not None:  # the pod DNS asks the mesh model for mesh names
            dns.lookup = self.mesh.name_lookup
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
            node_name = self.node.node_name
            self.slices, self.meshpods = kube_loops.start_projections(self.mesh, node_name, o, watcher)
            self.gamma_lease, self.gamma_status = kube_loops.start_route_status(
                self.mesh, node_name, o, watcher)

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
        return probes.readiness_checks(self.node, self.options, self.sink,
                                       lambda: self.role == "serving" and self.started.is_set())

    def _start_metrics(self) -> None:
        self.metrics = m = probes.wire_metrics(self)

        def ready() -> tuple[bool, str]:
            failing = [k for k, ok in self.readiness_checks().items() if not ok]
            return not failing, ", ".join(failing) or "ready"

        self.metrics_server = probes.bind_metrics_server(
            m, self.options, live=lambda: not self.stopped.is_set(), ready=ready)
        self.metrics_server.start()
        log.info("metrics on %s:%d (/metrics /healthz /readyz)", self.metrics_server.host,
                 self.metrics_server.port)

    def _start_node_loops(self) -> None:
        self.repair, self.readiness = kube_loops.start_node_loops(
            self.node, self.options, self.sink, lambda: {p.uid for p in self.store.all()},
            self.source.record_event)

    def stop(self) -> None:
        self.gate.sigterm_at = time.monotonic()
        self.gate.await_outcome(60.0)  # a take-over under way: SIGTERM waits for its outcome
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
        self._stop_enrollment()
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

    def _stop_enrollment(self) -> None:
        if self.enrollment is not None:
            self.enrollment.stop()
            self.enrollment = None

    def _release_on_removal(self, wait_s: float = 30.0) -> None:
        """Our DaemonSet is being deleted: once `cni-install` has taken aether-cni out of the
        CNI config (so no new pod is captured), release every pod; an upgrade never gets
        here (the DaemonSet is still there)."""
        recorded.await_plugin_removed(self.options, wait_s)
        self.release_all("our DaemonSet is being deleted")

    def release_all(self, why: str) -> dict[str, Any]:
        """Release every captured pod (uninstall, or our DaemonSet deleted): no new capture
        from here on, each pod's table then its listener, and nothing remembered."""
        self.handler.uninstalling = True
        self._stop_enrollment()
        return recorded.release_all(self.handler, self.store, why)

    def reconcile(self) -> None:
        """Bring recorded pods back to their recorded capture (or forget them if dead)."""
        recorded.reconcile(self.store, self.dataplane, self.sink, self.node, self._note)

    def _drop_leftover_release_tables(self) -> None:
        """A pod released live keeps an empty table for a few seconds; an agent that died in
        them left it behind. An uncaptured pod never holds one: drop it."""
        recorded.drop_leftover_release_tables(self.store, self.dataplane, self._note)

    def _note(self, msg: str) -> None:
        log.warning("reconcile: %s", msg)
        self.reconcile_report.append(msg)

    # -- status (agent.runtime.status_doc) --------------------------------------------------
    def status(self) -> dict[str, Any]:
        return status_doc.status(self)

    def takeover_state(self) -> dict[str, Any]:
        """Which agent serves, and the one being replaced with its drain progress."""
        return self.gate.takeover_state(self.sink, self.instance, self.options.peer)

    def cni_install_state(self) -> dict[str, Any]:
        """Which conflist kubelet uses, whether our entry and binary are there, last repair."""
        return status_doc.cni_install_state(self.options, self.node.run_dir)

    def pod_status(self, key: str, dest: str | None, caller: str | None = None,
                   port: int | None = None) -> dict[str, Any]:
        """One pod in depth: rules as programmed, its listener, where dest would go and,
        with ``caller``, what its AuthorizationPolicies decide for that caller."""
        return status_doc.pod_status(self, key, dest, caller, port)

    def _status_request(self, request: Any) -> dict[str, Any]:
        """`{"command": "status"}` or `{"command": "pod", "pod": "<ns>/<name>", "dest":
        "IP:port" | null}`; anything else is answered with what was expected."""
        return status_doc.status_request(self, request)
