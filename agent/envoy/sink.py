"""The node Envoy as the CNI handler's listener sink: xDS server + supervised Envoy.

ADD returns only once Envoy has ACKed a config holding the pod's listener; a NACK or a
timeout fails the ADD (fail closed). An Envoy left running by a previous agent process is
adopted (its pid is recorded in the run dir) so an agent restart never drops live listeners.

``EnvoySink`` is assembled here from its parts, each a mixin in a module of its own:
``agent.envoy.sink_publish`` (the shared publish and its ACK wait), ``sink_pods`` (per-pod
policies), ``sink_listeners`` (what Envoy holds of each listener), ``sink_process`` (the
Envoy process: spawn, adoption, watchdog, retire, stop) and ``sink_stats`` (Envoy's stats).
This module keeps the construction, the start, the ListenerSink calls and status.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psutil

from agent.authz.policy import Policy
from agent.cni.state import CapturedPod
from agent.common.config import NodeConfig
from agent.envoy.bootstrap import build_bootstrap, ensure_private_dir, write_bootstrap
from agent.envoy.compat import BUILT_FOR, wire_patch
from agent.envoy.golden import GoldenFold
from agent.envoy.listener_view import ListenerProbe
from agent.envoy.resources import PodListener, Resilience
from agent.envoy.sink_listeners import ListenerTracking
from agent.envoy.sink_pods import PodBook
from agent.envoy.sink_process import EnvoyProcess
from agent.envoy.sink_publish import PIPELINE_WAIT_S, ListenerNotConfirmed, SharedPublish
from agent.envoy.sink_stats import EnvoyStats
from agent.envoy.supervisor import EnvoySupervisor, LogTailer, envoy_child
from agent.envoy.traffic import MAX_SERIES, AccessRecorder
from agent.envoy.xds import XdsServer
from agent.identity.manager import IdentityManager
from agent.netns.enter import NetnsError, netns_identity
from agent.netns.families import NoLoopback, loopback_families, require_loopback
from agent.scope.route_tables import GammaResult

__all__ = ["ADOPTED_HOLD_MAX_S", "NETNS_CONFIRM_INTERVAL_S", "NETNS_CONFIRM_SAMPLES", "PIPELINE_WAIT_S",
           "EnvoySink", "ListenerNotConfirmed", "listener_name", "pod_listener"]

log = logging.getLogger("aether.envoy")

# A leaked netns must still be foreign after this many re-samples this far apart (a bind's
# legitimate visit lasts microseconds; the leak lasts until Envoy exits).
NETNS_CONFIRM_SAMPLES = 5
NETNS_CONFIRM_INTERVAL_S = 0.05
# How long an adopted Envoy is sent nothing while the restarted agent loads its Services
# (the mesh sources' own sync bound is 30 s; then they publish what they know)
ADOPTED_HOLD_MAX_S = 60.0


def listener_name(pod: CapturedPod) -> str:
    return f"capture-{pod.container_id}"


def pod_listener(pod: CapturedPod, source_pods: bool = False) -> PodListener:
    """The pod's listener on the loopback families its netns really has (a pod with IPv6
    disabled gets 127.0.0.1 only: asking Envoy for ::1 there would fail the bind). An ADD
    read them on its visit to program the rules; a pod re-served after a restart is asked."""
    v4, v6 = (loopback_families(pod.netns) if pod.loopback is None
              else require_loopback(pod.netns, pod.loopback))
    return _listener_of(pod, v4, v6, source_pods)


def _listener_of(pod: CapturedPod, ipv4: bool = True, ipv6: bool = True,
                 source_pods: bool = False) -> PodListener:
    return PodListener(uid=pod.container_id, netns_path=pod.netns, namespace=pod.namespace,
                       ipv4=ipv4, ipv6=ipv6, service_account=pod.service_account or "default",
                       ips=tuple(ip.split("/")[0] for ip in pod.ips),
                       workload=pod.workload or pod.name,
                       source_pod=pod.name if source_pods else "")


class EnvoySink(SharedPublish, PodBook, ListenerTracking, EnvoyProcess, EnvoyStats):
    def __init__(self, node: NodeConfig, binary: str | None = None, admin_port: int | None = None,
                 ack_timeout: float = 10.0, delta: bool = True, concurrency: int = 0,
                 hang_timeout: float = 15.0, hang_busy_timeout: float = 180.0, cgroup: str | None = None,
                 access_log: bool = False, identity: IdentityManager | None = None,
                 resilience: Resilience | None = None, traffic_metrics: bool = True,
                 traffic_max_series: int = MAX_SERIES, traffic_source_pods: bool = False,
                 slot: str = "envoy") -> None:
        # <run-dir>/<slot>: this agent's Envoy files; a take-over runs its Envoy in the other
        # slot beside the old agent's (agent.runtime.takeover)
        self.slot = slot
        self.retired_at: float | None = None  # when a successor took over (draining since)
        self.hold_until_services = False  # a take-over's Envoy: nothing before the Services
        self.traffic_metrics = traffic_metrics  # every connection and request counted in Envoy
        self.traffic_source_pods = traffic_source_pods  # the golden metrics' src_pod label
        # a JSON record per captured connection and HTTP request (agent.access logger)
        self.access_log = access_log
        # outlier detection, connect retries, limits on every Service cluster
        self.resilience = resilience or Resilience()
        # the SVIDs of this node's identities (mTLS mesh hop); None: plaintext mesh
        self.identity = identity
        self.hang_timeout = hang_timeout
        # a silent Envoy whose main thread keeps working gets this long before it counts hung
        self.hang_busy_timeout = max(hang_busy_timeout, hang_timeout)
        self.busy_silences = 0  # silences that were a busy main thread, not a hang
        self._envoy_traffic: tuple[float, dict[str, Any]] | None = None
        self._envoy_traffic_lock = threading.Lock()
        self.hang_kills = 0
        self.netns_restarts = 0  # Envoy found outside the node netns and restarted
        self.metrics: Any = None  # agent.ops.metrics.Metrics: xDS push-to-ACK durations
        self.node = node
        self.ack_timeout = ack_timeout
        self.dir = os.path.join(node.run_dir, slot)
        ensure_private_dir(self.dir)  # 0700: it holds the admin socket
        from agent.runtime.takeover import xds_socket
        self.xds_socket = xds_socket(node.run_dir, slot)
        self.bootstrap_path = os.path.join(self.dir, "bootstrap.json")
        self.pid_path = os.path.join(self.dir, "envoy.pid")
        # Envoy's admin can stop every pod's listener: a root-only unix socket unless a TCP
        # port (reachable by any local user) is asked for explicitly.
        self.admin = (os.path.join(self.dir, "admin.sock") if admin_port is None
                      else f"127.0.0.1:{admin_port}")
        self._bootstrap_args = (node.node_name, self.xds_socket,
                                self.admin if admin_port is None else admin_port, delta)
        write_bootstrap(self.bootstrap_path, build_bootstrap(
            *self._bootstrap_args[:3], delta=delta))
        self.listener_probe = ListenerProbe(self.admin)  # status: Envoy's own listener view
        self.xds = XdsServer(self.xds_socket, log=logging.getLogger("aether.xds"))
        # the golden metrics' cardinality cap over Envoy's series (agent.envoy.golden)
        self.golden_fold = GoldenFold(traffic_max_series)
        if access_log:
            access = logging.getLogger("agent.access")
            self.xds.access_records = AccessRecorder(
                lambda rec: access.info("access", extra=rec))
        self.xds.on_nack = self._on_nack
        self.log_path = os.path.join(self.dir, "envoy.log")
        if concurrency <= 0:
            # the node Envoy shares the node with the pods it serves: half the CPUs this
            # process may use (affinity, cgroup quota), not the machine's (measured on 2
            # vCPUs: one worker relays 16% more requests/s than two competing with load)
            from agent.envoy.cpus import default_envoy_workers
            concurrency = default_envoy_workers()
        self.supervisor = EnvoySupervisor(binary, self.bootstrap_path, self.admin,
                                          concurrency=concurrency, log_file=self.log_path,
                                          use_keeper=True, on_spawn=self._write_pid,
                                          cgroup=cgroup)
        self.tailer = LogTailer(self.log_path, logging.getLogger("envoy"))
        self._pods: dict[str, PodListener] = {}
        # AuthorizationPolicies (agent.authz): the ones selecting each pod (by pod key) as
        # the mesh last published them, and the resolver an ADD asks with the pod's labels
        # (so its first listener already enforces them)
        self._authz: dict[str, tuple[Policy, ...]] = {}
        self._pod_keys: dict[str, str] = {}  # container id -> pod key
        self._pod_labels: dict[str, dict[str, str]] = {}  # as its ADD read them
        # the captured pods in scoped capture (only the mesh port redirected): while there
        # is one, each Service's HTTP port is served on the mesh port too (its chains cost
        # as much again as the real ports': not built for a node of redirect-all pods)
        self._scoped: set[str] = set()
        self.authz_for: Callable[[str, dict[str, str]], tuple[Policy, ...]] | None = None
        self.xds.inbound.resolve = self._identity_of_listener
        # pods whose listener Envoy rejected, withdrawn from the config: cid -> Envoy's reason
        self._rejected: dict[str, str] = {}
        self._removals: dict[str, str] = {}  # cid -> xDS version that dropped its listener
        self._netns_killed: int | None = None  # the Envoy pid last killed for its netns
        self._services: tuple[Any, ...] = ()
        self._gamma: GammaResult | None = None
        self._learnable: tuple[tuple[str, int], ...] | None = None
        self._lock = threading.Lock()
        # concurrent ADDs share publishes (``_publish_shared``): tickets, the ticket the last
        # finished publish covered, its version, and whether one is being built
        self._batch = threading.Condition(threading.Lock())
        self._ticket = 0
        self._covered = 0
        self._covered_version = ""
        self._covered_at = 0.0
        self._batch_busy = False
        self._incoming: dict[str, PodListener] = {}
        self.shared_publishes = 0  # ADDs whose listener rode another ADD's publish
        self._adopted: psutil.Process | None = None
        self._retired_adopted: psutil.Process | None = None  # adopted, then retired
        self._adopt_watch: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------
    def preload(self, pods: list[CapturedPod]) -> None:
        """Pods recorded by a previous agent: served from the first snapshot, so a
        reconnecting Envoy is told nothing changed (no listener drained and re-bound)."""
        with self._lock:
            for pod in pods:
                try:
                    self._pods[pod.container_id] = pod_listener(pod, self.traffic_source_pods)
                except (NoLoopback, NetnsError, OSError, TimeoutError) as e:
                    # reconcile re-pins or drops it next; until then serve what was recorded
                    log.warning("cannot read the loopback of recorded pod %s (%s): serving "
                                "both families until reconcile settles it", pod.key, e)
                    self._pods[pod.container_id] = _listener_of(
                        pod, source_pods=self.traffic_source_pods)
                self._pod_keys[pod.container_id] = pod.key
                if self.identity is not None:
                    self.identity.attach(self._pods[pod.container_id].identity, pod.key)

    def start(self) -> None:
        version = self.supervisor.check_version()
        if version < BUILT_FOR:  # the previous release: served with agent.envoy.compat
            log.info("envoy %s is older than %s: its bootstrap leaves out the newer runtime "
                     "guard and logs name no listener", ".".join(map(str, version)),
                     ".".join(map(str, BUILT_FOR)))
            name, sock, admin, delta = self._bootstrap_args
            write_bootstrap(self.bootstrap_path, build_bootstrap(
                name, sock, admin, delta=delta, envoy_version=version))
            self.xds.wire_patch = wire_patch(version)
        old = self._previous_envoy()
        if old is not None or self.hold_until_services:
            # the adopted Envoy holds the previous agent's full config: it is sent nothing
            # (not even the empty snapshot of a server just started) until this agent's
            # Services are in (the first ``set_services``), or a bound. A take-over's new
            # Envoy likewise: its listeners, bound, take a share of new connections at once
            # (SO_REUSEPORT), so they must come with the Services they demux to.
            self.xds.hold()
        self.xds.start()
        if old is not None:
            self._seed_from_adopted()
        if self.xds.held:
            threading.Thread(target=self._release_after, args=(ADOPTED_HOLD_MAX_S,),
                             name="xds-hold", daemon=True).start()
        self._publish()  # an empty (or restored) snapshot so Envoy's first fetch completes
        self.tailer.start()
        if old is not None:
            log.info("adopting envoy pid=%d left running by the previous agent", old.pid)
            self._adopted = old
            self._adopt_watch = threading.Thread(target=self._watch_adopted, daemon=True)
            self._adopt_watch.start()
        else:
            self._spawn()
        threading.Thread(target=self._watchdog, name="envoy-watchdog", daemon=True).start()
        if self.identity is not None:
            threading.Thread(target=self._renewer, name="svid-renewer", daemon=True).start()

    def check_envoy_netns(self, why: str) -> bool:
        """Envoy enters a pod's netns to bind its listener; on a failed bind it can stay there
        (docs/envoy-netns-leak.md), and every socket its main thread opens afterwards lands in
        that pod's network. Compare Envoy's netns with ours; if it moved, restart it (the
        listeners come back from xDS, pods stay captured). True when Envoy is where it belongs."""
        pid = self.pid
        if pid is None:
            return True
        try:
            here = netns_identity("/proc/self/ns/net")
            there = netns_identity(f"/proc/{pid}/ns/net")
            # Envoy's main thread is in a pod's netns, legitimately, for the few microseconds
            # of each listener bind: one sample can land in that window. The leak is
            # persistent, so only a netns that stays foreign across every re-sample counts.
            for _ in range(NETNS_CONFIRM_SAMPLES):
                if here == there:
                    return True
                time.sleep(NETNS_CONFIRM_INTERVAL_S)
                there = netns_identity(f"/proc/{pid}/ns/net")
        except OSError:
            return True  # exited meanwhile: the supervisor restarts it
        if here == there:
            return True
        if pid == self._netns_killed:
            return False  # already killed for this; the supervisor is restarting it
        self._netns_killed = pid
        self.netns_restarts += 1
        log.error("envoy pid=%d is in netns inode %d, not the node's (%d) (%s): restarting it "
                  "so no socket of the node proxy opens in a pod's network", pid, there[1],
                  here[1], why)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return False

    # -- ListenerSink --------------------------------------------------------------------
    def restore_pod(self, pod: CapturedPod) -> None:
        """A pod recorded by the previous agent, at start: as ``add_pod``, but while an
        adopted Envoy is held (``XdsServer.hold``) its ACK is not awaited: that Envoy serves
        the recorded listener already, and gets this agent's version at release. Waiting
        would hold the agent's start (the Services load after the pods are restored) for
        an ACK that cannot come before it."""
        self.add_pod(pod, confirm=not self.xds.held)

    def add_pod(self, pod: CapturedPod, confirm: bool = True) -> None:
        started = time.monotonic()
        try:
            listener = pod_listener(pod, self.traffic_source_pods)
        except (NoLoopback, NetnsError, OSError, TimeoutError) as e:
            raise ListenerNotConfirmed(f"cannot read the loopback of {pod.key}: {e}") from e
        listener = replace(listener, authz=self._policies_of(pod))
        with self._lock:
            self._pod_keys[pod.container_id] = pod.key
            if pod.labels is not None:
                self._pod_labels[pod.container_id] = dict(pod.labels)
            if not pod.policy.redirect_all:
                self._scoped.add(pod.container_id)
        if self.identity is not None:
            # issued before the listeners that name it: Envoy gets the secret first
            self.identity.attach(listener.identity, pod.key)
        version, pushed = self._publish_shared(pod.container_id, listener,
                                               started + self.ack_timeout)
        if not confirm:
            return
        self._confirm(version, f"listener {listener_name(pod)} for {pod.key}", pod.container_id,
                      started, pushed)

    def set_access_callback(self, cb: Callable[[str, int], None] | None) -> None:
        """Passthrough connections (the gRPC access log) feed dependency learning. Runs on a
        gRPC thread once per passthrough connection: the callback must stay fast."""
        self.xds.set_access_callback(None if cb is None else (lambda _lis, ip, port: cb(ip, port)))

    def has_listener(self, container_id: str) -> bool:
        with self._lock:
            return container_id in self._pods

    def remove_pod(self, pod: CapturedPod) -> None:
        """Withdraw the pod's listener and return at once: DEL never waits on the proxy (a
        hung or crash-looping Envoy must not leave pods stuck Terminating). The removal
        settles with Envoy's next ACK; until then status lists it as pending. A listener
        socket Envoy still holds only keeps the dead pod's netns alive, it captures nothing."""
        with self._lock:
            self._rejected.pop(pod.container_id, None)
            self._pod_keys.pop(pod.container_id, None)
            self._pod_labels.pop(pod.container_id, None)
            self._scoped.discard(pod.container_id)
            gone = self._pods.pop(pod.container_id, None)
            if gone is None:
                return
            if self.identity is not None:
                self.identity.detach(gone.identity, pod.key)
            self._removals[pod.container_id] = self._publish()

    # -- status --------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        if self._adopted is not None:
            return envoy_child(self._adopted.pid)
        return self.supervisor.pid

    def status(self) -> dict[str, Any]:
        sup = self.supervisor.status()
        if self._adopted is not None:
            try:
                pid = envoy_child(self._adopted.pid)
                envoy = psutil.Process(pid) if pid else self._adopted
                sup.update(pid=pid, adopted=True, rss_bytes=envoy.memory_info().rss,
                           uptime_s=round(time.time() - envoy.create_time(), 1))
            except psutil.Error:
                pass
        x = self.xds.status()
        ready = self.ready()
        ident = self.identity.status() if self.identity is not None else None
        if ident is not None:
            ident = {**ident, "accepted": self.xds.inbound.status()}
        return {
            **sup,
            "ready": ready,
            "admin": self.admin,
            "listeners": len(self._pods),
            "xds_version": x.get("version"),
            "acked_version": x.get("acked"),
            "xds_streams": x.get("connected_streams"),
            "nack_count": x.get("nack_count"),
            "last_nack": x.get("last_nack"),
            "hang_kills": self.hang_kills,
            "shared_publishes": self.shared_publishes,
            "busy_silences": self.busy_silences,
            "netns_restarts": self.netns_restarts,
            "pending_removals": self.pending_removals(),
            # a pod without its SVID fails closed: the node says so
            "degraded": bool(sup.get("degraded")) or not ready or bool(ident and ident["problems"]),
            "identity": ident,
        }
