"""The node Envoy as the CNI handler's listener sink: xDS server + supervised Envoy.

ADD returns only once Envoy has ACKed a config holding the pod's listener; a NACK or a
timeout fails the ADD (fail closed). An Envoy left running by a previous agent process is
adopted (its pid is recorded in the run dir) so an agent restart never drops live listeners.
"""

from __future__ import annotations

import json
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
from agent.envoy import watchdog
from agent.envoy.bootstrap import build_bootstrap, ensure_private_dir, write_bootstrap
from agent.envoy.compat import BUILT_FOR, wire_patch
from agent.envoy.golden import GoldenFold
from agent.envoy.judge import JUDGE_LISTENER_PREFIX
from agent.envoy.listener_view import (
    REJECTED,
    ListenerProbe,
    ListenerState,
    listener_state,
    nack_names,
)
from agent.envoy.resources import LISTENER_TYPE, NodeXdsState, PodListener, Resilience
from agent.envoy.supervisor import EnvoySupervisor, LogTailer, envoy_child
from agent.envoy.traffic import MAX_SERIES, AccessRecorder
from agent.envoy.watchdog import main_thread_cpu
from agent.envoy.xds import XdsServer
from agent.identity.manager import IdentityManager
from agent.netns.enter import NetnsError, netns_identity
from agent.netns.families import NoLoopback, loopback_families, require_loopback
from agent.scope.route_tables import GammaResult

log = logging.getLogger("aether.envoy")

# A leaked netns must still be foreign after this many re-samples this far apart (a bind's
# legitimate visit lasts microseconds; the leak lasts until Envoy exits).
NETNS_CONFIRM_SAMPLES = 5
NETNS_CONFIRM_INTERVAL_S = 0.05
# How long a shared listener publish holds the next one while it waits for Envoy's answer
PIPELINE_WAIT_S = 1.0
# How long an adopted Envoy is sent nothing while the restarted agent loads its Services
# (the mesh sources' own sync bound is 30 s; then they publish what they know)
ADOPTED_HOLD_MAX_S = 60.0


class ListenerNotConfirmed(Exception):
    pass


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


class EnvoySink:
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

    def _renewer(self) -> None:
        """Renew SVIDs at half life (and retry failed ones); each change is pushed over SDS.
        Envoy uses a rotated certificate for new handshakes; open connections keep going."""
        assert self.identity is not None
        while not self._stopping.wait(min(5.0, max(0.05, self.identity.next_due()))):
            try:
                if self.identity.renew_due():
                    with self._lock:
                        self._publish()
            except Exception:  # noqa: BLE001 - the renewer must outlive one bad round
                log.exception("SVID renewal failed")

    def _watchdog(self) -> None:
        """A hung Envoy (SIGSTOP, deadlock) keeps its sockets open: the kernel still accepts
        into the backlog, so nothing crashes and nothing restarts it. Kill it when its admin
        stops answering for hang_timeout and its main thread makes no progress (a main thread
        busy applying a big push is not hung: ``agent.envoy.watchdog``); the supervisor then
        restarts it with backoff."""
        from agent.envoy.supervisor import admin_request

        last_pid: int | None = None
        last_answer = time.monotonic()
        last_cpu: float | None = None
        last_check = time.monotonic()
        said_busy = False
        while not self._stopping.wait(1.0):
            pid = self.pid
            if pid != last_pid:
                last_pid, last_answer, last_cpu = pid, time.monotonic(), None
            if pid is None:
                continue
            self.check_envoy_netns("periodic check")
            answered = False
            try:
                admin_request(self.admin, "GET", "/ready", timeout=1.0)
                answered, last_answer = True, time.monotonic()
                if said_busy:
                    log.info("envoy pid=%d answers its admin again", pid)
                said_busy = False
            except Exception:  # noqa: BLE001 - no answer, a reset or a garbled one: silence
                pass
            now = time.monotonic()
            cpu = main_thread_cpu(pid)
            delta = None if cpu is None or last_cpu is None else cpu - last_cpu
            window, last_cpu, last_check = now - last_check, cpu, now
            silent = 0.0 if answered else now - last_answer
            state = watchdog.verdict(silent, delta, window, self.hang_timeout,
                                     self.hang_busy_timeout)
            if state == "busy" and not said_busy:
                said_busy = True
                self.busy_silences += 1
                log.warning("envoy pid=%d has not answered its admin for %.0fs, its main thread "
                            "busy (%.0f%% of a CPU): not hung, waiting up to %.0fs", pid, silent,
                            100 * (delta or 0) / max(window, 1e-6), self.hang_busy_timeout)
            elif state == "hung":
                log.error("envoy pid=%d has not answered its admin for %.0fs (hung); killing "
                          "it so the supervisor restarts it", pid, silent)
                self.hang_kills += 1
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                last_answer, said_busy = time.monotonic(), False

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

    def _spawn(self) -> None:
        self.supervisor.start()

    def _write_pid(self, pid: int) -> None:
        """The keeper's pid, rewritten on every (re)spawn, so a restarted agent adopts the
        Envoy that is actually running."""
        tmp = self.pid_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.replace(tmp, self.pid_path)

    def _previous_envoy(self) -> psutil.Process | None:
        try:
            with open(self.pid_path) as f:
                pid = int(f.read().strip())
            proc = psutil.Process(pid)
            if self.bootstrap_path in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def _seed_from_adopted(self) -> None:
        """Tell the builder which internal listener each namespace's cluster reaches in the
        Envoy about to be adopted, and which it has (``agent.envoy.adopted``). Best effort:
        an Envoy that does not answer is rebuilt as if new (its first push may then move a
        cluster and add its listener together)."""
        from agent.envoy import adopted
        from agent.envoy.supervisor import admin_request

        def dump(path: str) -> dict[str, Any]:
            code, body = admin_request(self.admin, "GET", path, timeout=10.0)
            if code != 200:
                raise RuntimeError(f"{path}: HTTP {code}: {body[:200]}")
            got = json.loads(body or "{}")
            return got if isinstance(got, dict) else {}

        try:
            reach = adopted.namespace_reach(dump(adopted.CLUSTERS_PATH))
            names = adopted.listener_names(dump(adopted.LISTENERS_PATH))
        except Exception as e:  # noqa: BLE001 - an unreadable Envoy is handled as a new one
            log.warning("could not read the adopted envoy's internal listeners (%s); its first "
                        "push is built as for a new envoy", e)
            return
        self.xds.seed(reach, names)
        log.info("adopted envoy holds %d namespace cluster(s) and internal listener(s) %s",
                 len(reach), ", ".join(names) or "none")

    def _watch_adopted(self) -> None:
        """Supervise an adopted Envoy by polling; when it dies, start our own."""
        while not self._stopping.wait(0.2):
            proc = self._adopted
            if proc is None:
                return
            try:
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                log.error("adopted envoy pid=%d exited; starting a new one", proc.pid)
                self._adopted = None
                try:
                    self._spawn()
                except Exception:  # noqa: BLE001 - keep trying rather than die silently
                    log.exception("starting envoy failed; retrying")
                    self._adopted = proc
                    continue
                return

    def restart_adopted(self, why: str, timeout: float = 10.0) -> bool:
        """Stop the adopted Envoy (its keeper forwards the signal and exits with it); the
        adoption watch then starts our own. False when no Envoy is adopted."""
        proc = self._adopted
        if proc is None:
            return False
        log.warning("restarting the adopted envoy (keeper pid=%d): %s", proc.pid, why)
        try:
            proc.terminate()
            proc.wait(timeout)
        except psutil.TimeoutExpired:
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return True

    def wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.1)
        return False

    def envoy_traffic(self) -> dict[str, Any]:
        """What Envoy's stats hold of the traffic, read from its admin and reused for a
        second (a scrape and a ``top`` sample in the same second ask Envoy once):
        ``golden``, the golden metrics (``agent.envoy.golden``, capped), and ``envoy``,
        passthrough by destination class and open connections per Service
        (``agent.envoy.envoy_stats``). Raises OSError or ValueError when the admin does
        not answer."""
        import json
        import urllib.parse

        from agent.envoy import envoy_stats, golden
        from agent.envoy.supervisor import admin_request
        with self._envoy_traffic_lock:
            cached = self._envoy_traffic
            if cached is not None and time.monotonic() - cached[0] < 1.0:
                return cached[1]
            path = "/stats?format=json&filter=" + urllib.parse.quote(envoy_stats.STATS_FILTER)
            code, body = admin_request(self.admin, "GET", path, timeout=1.0)
            if code != 200:
                raise ValueError(f"envoy admin answered {code} for its stats")
            served = [f"{v.namespace}/{v.name}" for v in self._services]
            figures: dict[str, Any] = {"envoy": envoy_stats.parse(json.loads(body), served)}
            path = "/stats/prometheus?filter=" + urllib.parse.quote(golden.STATS_FILTER)
            code, text = admin_request(self.admin, "GET", path, timeout=2.0)
            if code != 200:
                raise ValueError(f"envoy admin answered {code} for its golden stats")
            series = golden.parse_prometheus(text)
            resolve = None
            if series.inbound:
                with self._lock:
                    pods, views = tuple(self._pods.values()), self._services
                resolve = golden.service_resolver(views, pods)
            figures["golden"] = self.golden_fold.snapshot(series, resolve)
            figures["authz"] = self._authz_decisions()
            self._envoy_traffic = (time.monotonic(), figures)
            return figures

    def golden_traffic(self) -> dict[str, Any]:
        """The golden metrics snapshot (``/metrics``, ``aether-agent top``)."""
        golden: dict[str, Any] = self.envoy_traffic()["golden"]
        return golden

    def envoy_figures(self) -> dict[str, Any]:
        """Passthrough by destination class, open connections per Service and the
        AuthorizationPolicy decisions (``authz``)."""
        traffic = self.envoy_traffic()
        return {**traffic["envoy"], "authz": traffic.get("authz") or {}}

    def ready(self) -> bool:
        from agent.envoy.supervisor import admin_request
        try:
            code, body = admin_request(self.admin, "GET", "/ready", timeout=1.0)
        except OSError:
            return False
        return code == 200 and body.strip() == "LIVE"

    def retire(self) -> None:
        """A successor serves the node now: never restart this Envoy again, close its
        listeners at once (the successor's, in the same SO_REUSEPORT groups, get the queued
        connections: tcp_migrate_req) and make its HTTP connections close cleanly after
        their current request (failing health check: Connection: close, HTTP/2 GOAWAY). L4
        connections keep going until ``stop``."""
        from agent.envoy.supervisor import admin_request
        self.retired_at = time.monotonic()
        self.supervisor.detach()  # a crash now must not bring listeners back
        adopted, self._adopted = self._adopted, None
        if adopted is not None:
            self._retired_adopted = adopted
        for path in ("/healthcheck/fail", "/drain_listeners"):
            try:
                code, body = admin_request(self.admin, "POST", path, timeout=5.0)
                if code != 200:
                    log.error("retiring envoy: POST %s answered %d %s", path, code, body[:200])
            except OSError as e:
                log.error("retiring envoy: POST %s failed: %s", path, e)
        log.info("retired: envoy stopped listening; its open connections drain")

    def open_connections(self) -> int | None:
        """Downstream connections this Envoy still carries (a retiring one's drain)."""
        from agent.envoy.supervisor import admin_request
        try:
            code, body = admin_request(self.admin, "GET",
                                       "/stats?filter=^server.total_connections$", timeout=2.0)
        except OSError:
            return None
        for line in body.splitlines() if code == 200 else []:
            key, _, value = line.partition(": ")
            if key == "server.total_connections":
                return int(value)
        return None

    def stop(self, keep_envoy: bool = False) -> None:
        """Stop serving. ``keep_envoy``: leave the keeper and Envoy running with their last
        config (an agent upgrade or restart), for the next agent to adopt."""
        self._stopping.set()
        if keep_envoy:
            self.supervisor.detach()
            self.xds.stop()
            self.tailer.stop()
            log.info("agent stopping; envoy keeps serving its last config for the next agent")
            return
        adopted = self._adopted or self._retired_adopted
        if adopted is not None:
            try:
                adopted.terminate()
                adopted.wait(5)
            except psutil.Error:
                pass
        self.supervisor.stop()
        self.xds.stop()
        self.tailer.stop()
        try:
            os.unlink(self.pid_path)
        except FileNotFoundError:
            pass

    # -- ListenerSink --------------------------------------------------------------------
    def _publish(self) -> str:
        state = NodeXdsState(pods=tuple(self._pods.values()),
                             capture_port=self.node.capture_port,
                             passthrough_mark=self.node.passthrough_mark,
                             services=self._services, gamma=self._gamma,
                             connection_log=self.access_log, learn_targets=self._learnable,
                             mesh_tls=self.identity.mesh_tls() if self.identity else None,
                             resilience=self.resilience,
                             traffic_metrics=self.traffic_metrics)
        return self.xds.set_state(state)

    def _confirm(self, version: str, what: str, pod_id: str | None = None,
                 started: float | None = None, pushed: float | None = None) -> None:
        """Wait for Envoy's ACK of ``version``, ``ack_timeout`` from ``started`` (now by
        default; an ADD counts from its own start, its wait in a shared publish included);
        ``pushed``: when that version went out (the push-to-ACK histogram's start).
        With ``pod_id``: a later version may be ACKed only because that pod's listener was
        withdrawn after a NACK (``_on_nack``); that is a rejection, never a confirmation."""
        now = time.monotonic()
        published = now if pushed is None else pushed
        deadline = (now if started is None else started) + self.ack_timeout
        while True:
            acked = self.xds.wait_acked(version, min(0.2, max(0.0, deadline - time.monotonic())))
            if pod_id is not None:
                with self._lock:
                    reason = self._rejected.get(pod_id)
                if reason is not None:
                    raise ListenerNotConfirmed(f"Envoy rejected {what}: {reason}")
            if acked:
                if self.metrics is not None:
                    self.metrics.observe_xds_push(time.monotonic() - published)
                return
            nack = self.xds.status().get("last_nack")
            if nack and str(nack.get("version")) == version:
                raise ListenerNotConfirmed(f"Envoy rejected {what}: {nack.get('error_detail')}")
            if time.monotonic() >= deadline:
                raise ListenerNotConfirmed(
                    f"Envoy did not ACK {what} within {self.ack_timeout:.0f}s "
                    f"(envoy pid {self.pid or 'none'}, xDS streams "
                    f"{self.xds.status().get('connected_streams')})")

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
        if self.identity is not None:
            # issued before the listeners that name it: Envoy gets the secret first
            self.identity.attach(listener.identity, pod.key)
        version, pushed = self._publish_shared(pod.container_id, listener,
                                               started + self.ack_timeout)
        if not confirm:
            return
        self._confirm(version, f"listener {listener_name(pod)} for {pod.key}", pod.container_id,
                      started, pushed)

    def _current_authz(self, cid: str, lis: PodListener) -> PodListener:
        """``lis`` with the policies as they are now (a policy may have changed since its
        ADD resolved them): from the labels the ADD read, when it read them."""
        labels, resolve = self._pod_labels.get(cid), self.authz_for
        if labels is None or resolve is None:
            return lis
        want = resolve(lis.namespace, labels)
        return lis if want == lis.authz else replace(lis, authz=want)

    def _policies_of(self, pod: CapturedPod) -> tuple[Policy, ...]:
        """The policies selecting ``pod`` at its ADD: from its labels when the ADD read them,
        else as the mesh last published them."""
        resolve = self.authz_for
        if pod.labels is not None and resolve is not None:
            return resolve(pod.namespace, pod.labels)
        with self._lock:
            return self._authz.get(pod.key, ())

    def set_authz(self, by_pod: dict[str, tuple[Policy, ...]],
                  known: frozenset[str] | None = None) -> int:
        """The policies selecting each local pod (pod key → policies; absent: none), applied
        at the next publish (``set_services`` follows). ``known``: the pods the mesh model
        holds (None: all); one it does not hold yet keeps what its ADD resolved. Returns how
        many pods changed."""
        changed = 0
        with self._lock:
            self._authz = by_pod
            for cid, lis in list(self._pods.items()):
                key = self._pod_keys.get(cid, "")
                if known is not None and key not in known:
                    continue
                want = by_pod.get(key, ())
                if lis.authz != want:
                    self._pods[cid] = replace(lis, authz=want)
                    changed += 1
        return changed

    def _authz_decisions(self) -> dict[Any, int]:
        """``agent.authz.stats.decisions`` over Envoy's RBAC counters (empty when no policy
        selects a pod here: nothing asked of Envoy)."""
        import json
        import urllib.parse

        from agent.authz import stats
        from agent.envoy.supervisor import admin_request
        with self._lock:
            pods = {lis.uid: (lis.namespace, lis.workload or lis.uid, lis.authz)
                    for lis in self._pods.values() if lis.authz}
        if not pods:
            return {}
        path = "/stats?format=json&filter=" + urllib.parse.quote(stats.STATS_FILTER)
        code, body = admin_request(self.admin, "GET", path, timeout=1.0)
        if code != 200:
            raise ValueError(f"envoy admin answered {code} for its RBAC stats")
        doc = json.loads(body)
        return stats.decisions(((str(s.get("name")), int(s.get("value") or 0))
                                for s in doc.get("stats") or [] if "value" in s), pods)

    def authz_of(self, container_id: str) -> tuple[Policy, ...]:
        """What the pod's inbound listener enforces now (status)."""
        with self._lock:
            lis = self._pods.get(container_id)
            return lis.authz if lis is not None else ()

    def _publish_shared(self, container_id: str, listener: PodListener,
                        deadline: float | None = None) -> tuple[str, float]:
        """Add ``listener`` and publish; returns a version that includes it and when that
        version was pushed (monotonic). Concurrent ADDs
        share publishes: while one builds and pushes, the listeners of the others gather in
        ``_incoming`` (no wait on the publish lock), and the next publish carries them all.
        So 16 pods starting at once cost Envoy a few LDS updates, each binding several
        listeners, instead of 16 in a row with every ADD waiting on the ACKs of all before
        it. Nothing waits for a batch to fill: a lone ADD publishes at once. ``deadline``
        (monotonic): the ADD's own; no wait here outlasts it."""
        with self._batch:
            self._incoming[container_id] = listener
            self._ticket += 1
            mine = self._ticket
            while True:
                if self._covered >= mine:
                    self.shared_publishes += 1
                    return self._covered_version, self._covered_at
                if not self._batch_busy:
                    self._batch_busy = True
                    incoming, self._incoming = self._incoming, {}
                    covers = self._ticket
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._incoming.pop(container_id, None)
                    raise ListenerNotConfirmed(
                        f"the listener of container {container_id} was not pushed to Envoy "
                        f"within {self.ack_timeout:.0f}s (a push before it got no answer)")
                self._batch.wait(left)
        version, pushed = "", 0.0
        try:
            with self._lock:
                for cid, lis in incoming.items():
                    self._rejected.pop(cid, None)
                    self._pods[cid] = self._current_authz(cid, lis)
                version = self._publish()
            pushed = time.monotonic()
            self._await_envoy(version, deadline)
        finally:
            with self._batch:
                self._batch_busy = False
                if version:  # on failure the listeners stay in _pods; a waiter publishes
                    self._covered, self._covered_version = covers, version
                    self._covered_at = pushed
                self._batch.notify_all()
        return version, pushed

    def _await_envoy(self, version: str, until: float | None = None) -> None:
        """Hold the next shared publish until Envoy answered this one (ACK or NACK), for at
        most ``PIPELINE_WAIT_S``: the ADDs arriving meanwhile gather into one push instead of
        each pushing its own. Envoy applies LDS updates one after another anyway, so under 16
        concurrent ADDs this is fewer builds, pushes and ACKs for the same wait, and a lone
        ADD loses nothing (it waits for this very ACK in ``_confirm``). A slow or NACKing
        Envoy holds the batch no longer than the cap (nor than ``until``, the leading
        ADD's own deadline), and with no Envoy connected there is nothing to wait for; nor
        while the xDS server is held (a take-over restoring its pods into an Envoy that gets
        nothing before the Services: at 110 pods the wait cost a minute, 1 s a pod)."""
        deadline = time.monotonic() + PIPELINE_WAIT_S
        if until is not None:
            deadline = min(deadline, until)
        if self.xds.held or not self.xds.status().get("connected_streams"):
            return
        while time.monotonic() < deadline:
            if self.xds.wait_acked(version, min(0.05, max(0.0, deadline - time.monotonic()))):
                return
            nack = self.xds.status().get("last_nack")
            if nack and int(str(nack.get("version") or -1)) >= int(version):
                return

    def _on_nack(self, type_url: str, detail: str) -> None:
        """Envoy rejected a config. Pod listeners it names are withdrawn: left in, every Envoy
        (re)start would be asked for them again and NACK again, and a failed bind can strand
        Envoy in the pod's netns, so a pod that holds its own capture port (it can bind it
        while Envoy restarts) would keep the node's Envoy in a restart loop. The pod fails
        closed instead (redirect rules stay, nothing listens) and status names the reason."""
        if type_url == LISTENER_TYPE:
            with self._lock:
                named = [cid for cid in self._pods if any(
                    nack_names(f"{prefix}{cid}", detail)
                    for prefix in ("capture-", "inbound-", "inbound-detect-",
                                   JUDGE_LISTENER_PREFIX))]
                for cid in named:
                    del self._pods[cid]
                    self._rejected[cid] = detail.strip()
                if named:
                    log.error("envoy rejected the listener of %d pod(s); withdrawn, their "
                              "traffic is refused until they are re-added: %s", len(named),
                              detail.strip())
                    self._publish()
        self.check_envoy_netns("after a NACK")

    def set_services(self, views: list[Any], gamma: GammaResult | None = None,
                     learnable: tuple[tuple[str, int], ...] | None = None) -> str:
        """The in-scope Services or their GAMMA tables changed: rebuild chains, clusters, EDS.
        ``learnable``: the (ClusterIP, port) pairs whose passthrough connections Envoy reports
        for dependency learning (None: all of them).
        Not awaited: a pod's ADD waits for its own listener, not for the mesh config."""
        with self._lock:
            self._services = tuple(views)  # the builder compares views by identity
            self._gamma = gamma
            self._learnable = learnable
            version = self._publish()
        self.xds.release()  # a no-op unless an adopted Envoy is still held
        return version

    def _release_after(self, seconds: float) -> None:
        """The hold's bound: an agent whose Services never come (a source that never
        syncs) still serves its adopted Envoy, with what it knows."""
        if self._stopping.wait(seconds) or not self.xds.held:
            return
        log.warning("no Services after %.0fs; sending the adopted envoy what is known", seconds)
        self.xds.release()

    def set_access_callback(self, cb: Callable[[str, int], None] | None) -> None:
        """Passthrough connections (the gRPC access log) feed dependency learning. Runs on a
        gRPC thread once per passthrough connection: the callback must stay fast."""
        self.xds.set_access_callback(None if cb is None else (lambda _lis, ip, port: cb(ip, port)))

    def _identity_of_listener(self, listener: str) -> str | None:
        """``inbound-<cid>`` → its pod's identity (for the inbound access log; a gRPC
        thread, so one dict read and no lock)."""
        from agent.envoy.mtls import INBOUND_LISTENER_PREFIX
        if not listener.startswith(INBOUND_LISTENER_PREFIX):
            return None
        pod = self._pods.get(listener[len(INBOUND_LISTENER_PREFIX):])
        return pod.identity if pod is not None else None

    def has_listener(self, container_id: str) -> bool:
        with self._lock:
            return container_id in self._pods

    def listener_states(self, container_ids: list[str]) -> dict[str, ListenerState]:
        """Each pod's listener as Envoy holds it (its admin's view plus our last NACK), not
        as the agent intends it. One cached, time-bounded admin probe for all pods."""
        x = self.xds.status()
        view = self.listener_probe.view(key=(self.pid, x.get("version"), str(x.get("acked")),
                                             x.get("nack_count")))
        with self._lock:
            rejected = {cid: self._rejected[cid] for cid in container_ids
                        if cid in self._rejected and cid not in self._pods}
        return {cid: (ListenerState(REJECTED, rejected[cid]) if cid in rejected
                      else listener_state(f"capture-{cid}", view, x.get("last_nack")))
                for cid in container_ids}

    def remove_pod(self, pod: CapturedPod) -> None:
        """Withdraw the pod's listener and return at once: DEL never waits on the proxy (a
        hung or crash-looping Envoy must not leave pods stuck Terminating). The removal
        settles with Envoy's next ACK; until then status lists it as pending. A listener
        socket Envoy still holds only keeps the dead pod's netns alive, it captures nothing."""
        with self._lock:
            self._rejected.pop(pod.container_id, None)
            self._pod_keys.pop(pod.container_id, None)
            self._pod_labels.pop(pod.container_id, None)
            gone = self._pods.pop(pod.container_id, None)
            if gone is None:
                return
            if self.identity is not None:
                self.identity.detach(gone.identity, pod.key)
            self._removals[pod.container_id] = self._publish()

    def _acked(self, version: str) -> bool:
        try:
            return self.xds.wait_acked(version, 0)
        except ValueError:  # so old the server forgot it: superseded long ago
            return True

    def pending_removals(self) -> list[str]:
        """Listeners withdrawn (DEL) whose removal Envoy has not ACKed yet."""
        with self._lock:
            pending = dict(self._removals)
        done = [cid for cid, v in pending.items() if self._acked(v)]
        with self._lock:
            for cid in done:
                if self._removals.get(cid) == pending[cid]:
                    del self._removals[cid]
            return sorted(f"capture-{cid}" for cid in self._removals)

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
