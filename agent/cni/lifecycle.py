"""The capture lifecycle of a pod, as one type: ADD (decide, pin, program, record, serve),
CHECK, DEL, the live enrollment of a running pod, the release of a captured one (with its
grace for the connections open through the proxy) and the in-place reapply of changed
exclusions, each with its rollback and cleanup paths next to it.

Every path either completes or leaves the pod failing ADD (fail closed): rules go in as one
atomic transaction, the state record is written only after the kernel holds the table, and
ADD returns only after the listener sink (Envoy) confirms the pod's listener is live.
The CNI wire side (the shim's envelope, the answers, STATUS, GC) is agent.cni.handler's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from agent.capture.policy import CaptureDecision, CapturePolicy, decide
from agent.capture.rules import render_create, render_releasing, render_ruleset
from agent.cni import protocol as p
from agent.cni import request as request_mod
from agent.cni.listener_sink import ListenerSink, NullSink
from agent.cni.messages import CniFailure, CniRequest
from agent.cni.netns_owners import NetnsOwners
from agent.cni.pod_locks import PodLocks
from agent.cni.pod_lookup import lookup_pod, redirect_all_default
from agent.cni.records import captured_record, seen_from_add, seen_from_release
from agent.cni.reporting import Counters, report_problems
from agent.cni.state import AddIntent, CapturedPod, StateStore
from agent.common.config import NodeConfig
from agent.common.ids import ContainerId
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane, NftDataplane
from agent.netns.enter import NetnsError, NetnsGone, NetnsId
from agent.source.base import MetadataSource
from agent.source.event_queue import EventQueue
from agent.source.model import NamespaceMeta, PodMeta

log = logging.getLogger("aether.cni")

# How long a released pod keeps its empty nat table: Envoy closes the connections of a removed
# listener within its drain time (2 s), and their FIN/RST need the NAT translation to reach
# the pod.
RELEASE_GRACE_S = 4.0


class CaptureLifecycle:
    """A node's captured pods, from ADD to release: the state (records, netns claims,
    per-container locks, releases in their grace) and every step that changes it."""

    def __init__(
        self,
        node: NodeConfig,
        source: MetadataSource,
        store: StateStore,
        sink: ListenerSink | None = None,
        dataplane: CaptureDataplane | None = None,
    ) -> None:
        self.node = node
        self.source = source
        self.store = store
        self.sink: ListenerSink = sink or NullSink()
        # what the lifecycle does to a pod's netns (libnftables and pins; a fake in tests)
        self.dataplane: CaptureDataplane = dataplane or NftDataplane()
        self.counters = Counters()
        # Events go out from a bounded queue: an ADD never waits on the API server for them
        self.events = EventQueue(source.record_event)
        self.recent_problems: deque[dict[str, Any]] = deque(maxlen=200)
        # registration hooks for the mesh model (the CNI is a registration source)
        self.on_captured: Callable[[CapturedPod, dict[str, str], dict[str, str]], None] | None = None
        self.on_released: Callable[[CapturedPod], None] | None = None
        self.metrics: Any = None  # agent.ops.metrics.Metrics when the metrics server runs
        # per-container locks that vanish once no request holds them (no growth per pod)
        self._locks = PodLocks()
        # who owns a pod netns: the records, and the ADDs in progress (their claims)
        self._owners = NetnsOwners(store, self.dataplane)
        self._netns_claims = self._owners.claims
        self.uninstalling = False  # set by uninstall: ADDs no longer capture
        # released pods whose empty table (and pin) go once the proxy closed their
        # connections: container id → (due, netns path, pinned)
        self._releasing: dict[str, tuple[float, str, bool]] = {}
        self._releasing_guard = threading.Lock()
        self._finisher: threading.Thread | None = None
        # the netconf's capture_redirect_all_default as the last ADD carried it: what a pod
        # found by its IP (no ADD of its own) is decided with
        self.last_redirect_all_default: bool | None = None

    def _pod_lock(self, container_id: str) -> AbstractContextManager[None]:
        return self._locks.hold(container_id)

    # -- ADD -----------------------------------------------------------------------------
    def _redirect_all_default(self, netconf: Mapping[str, Any]) -> bool:
        return redirect_all_default(netconf)

    def _lookup(self, args: Mapping[str, str]) -> tuple[PodMeta, NamespaceMeta | None] | None:
        """The pod and its namespace; None when the request is not for a pod (see
        `agent.cni.pod_lookup.lookup_pod`: unknown is try-again, never "not managed")."""
        return lookup_pod(self.node, self.source, args)

    def _add(self, req: CniRequest) -> bool:
        """True when the pod is now captured, False when it is not to be captured."""
        cid, kubelet_netns = req.container_id, req.netns
        looked = self._lookup(req.args)
        if looked is None:
            self.counters.add_skipped += 1
            log.info("ADD %s: no K8S_POD_NAMESPACE/K8S_POD_NAME, not a pod: not captured", cid)
            return False
        pod, namespace = looked
        decision = decide(pod, namespace, self.node, self._redirect_all_default(req.netconf))
        if decision.policy is not None and (decision.policy.strict or decision.policy.judged):
            # STRICT exempts the node's addresses (kubelet probes): read them now, a bridge
            # CNI may have given the node its gateway address in this very ADD
            decision = decide(pod, namespace, self.strict_node(max_age=0.0),
                              self._redirect_all_default(req.netconf))
        if not cid.startswith("discovered-"):
            self.last_redirect_all_default = self._redirect_all_default(req.netconf)
        if self.uninstalling:
            decision = CaptureDecision(False, "aether is being uninstalled from this node")
        fields = {"pod": pod.name, "namespace": pod.namespace, "container_id": cid}
        if not decision.captured or decision.policy is None:
            self.counters.add_skipped += 1
            log.info("ADD %s: not captured: %s", pod.key, decision.reason, extra=fields)
            self._remember(req, pod)
            return False
        if decision.problems:
            report_problems(pod, decision, self.counters, self.recent_problems, self.events)
        ident = self._owners.pod_netns(pod.key, kubelet_netns)
        with self._netns_claim(ident, cid, pod.key, kubelet_netns):
            return self._capture(req, pod, decision, fields)

    def _netns_claim(self, ident: NetnsId, cid: str, key: str, path: str
                     ) -> AbstractContextManager[None]:
        """Hold `ident` for container `cid`; refuse a netns another container id owns."""
        return self._owners.claim(ident, cid, key, path)

    def _capture(self, req: CniRequest, pod: PodMeta, decision: CaptureDecision,
                 fields: dict[str, str]) -> bool:
        """Pin, program, record, serve: the pod's netns is checked and claimed."""
        assert decision.policy is not None
        cid, kubelet_netns = req.container_id, req.netns
        netns = kubelet_netns
        pinned = False
        will_pin = self.dataplane.needs_pin(kubelet_netns)
        if will_pin:
            netns = os.path.join(self.node.run_dir, "netns", cid)
        # Before any step: a restarted agent finding this without a record undoes the steps
        # (agent/runtime/recovery.py); the record supersedes it.
        try:
            self.store.begin_add(AddIntent(cid, kubelet_netns, netns, will_pin))
        except OSError as e:
            raise CniFailure(p.ERR_CAPTURE_FAILED, f"cannot record the ADD of {pod.key}",
                             str(e)) from e
        if will_pin:
            try:
                self.dataplane.pin(kubelet_netns, netns)
            except OSError as e:
                self.store.end_add(cid)
                raise CniFailure(p.ERR_CAPTURE_FAILED, f"cannot pin netns of {pod.key}", str(e)) from e
            pinned = True
        _fault("crash-after-pin")
        try:
            fp, loopback = self.dataplane.capture(netns, render_ruleset(decision.policy),
                                                  first=render_create(decision.policy))
        except DATAPLANE_ERRORS as e:
            self._release_pin(netns, pinned)
            self.store.end_add(cid)
            raise CniFailure(
                p.ERR_CAPTURE_FAILED,
                f"programming capture rules in {netns} for {pod.key} failed; pod not started",
                str(e),
            ) from e
        _fault("crash-after-rules")
        record = captured_record(req, pod, decision, decision.policy, netns=netns, fingerprint=fp,
                                 pinned=pinned, loopback=loopback)
        # Recorded before the listener so a crash from here on is found and cleaned on restart.
        try:
            self.store.put(record)
        except OSError as e:
            self._drop_table(netns)
            self._release_pin(netns, pinned)
            self.store.end_add(cid)
            raise CniFailure(p.ERR_CAPTURE_FAILED, f"cannot record the capture of {pod.key}",
                             str(e)) from e
        self.store.end_add(cid)
        self.store.remove_seen(cid)
        _fault("crash-before-listener")
        try:
            self.sink.add_pod(record)
        except Exception as e:
            raise CniFailure(
                p.ERR_CAPTURE_FAILED,
                f"the proxy did not confirm the capture listener for {pod.key}; "
                "pod not started (its traffic would be refused)",
                str(e),
            ) from e
        _fault("crash-after-listener")
        self.counters.add_ok += 1
        if self.on_captured is not None:
            try:
                self.on_captured(record, pod.labels, pod.annotations)
            except Exception:  # registration is best effort; capture already holds
                log.exception("registering %s in the mesh model failed", pod.key)
        log.info("ADD %s captured (%s, %s)", pod.key, decision.policy.mode, decision.reason,
                 extra=fields)
        return True

    def _stale(self, path: str) -> bool:
        """`path` exists but is no network namespace (e.g. a pin file whose mount is gone)."""
        try:
            return self.dataplane.is_stale_pin(path)
        except OSError:
            return False

    def _release_pin(self, netns: str, pinned: bool) -> None:
        if pinned:
            try:
                self.dataplane.unpin(netns)
            except OSError as e:
                log.error("unpinning %s after a failed ADD: %s", netns, e)

    # -- live enrollment and release (agent/runtime/enroll.py decides, these act) -----------------
    def _remember(self, req: CniRequest, pod: PodMeta) -> None:
        """An uncaptured pod with a netns: remember it so a later label or annotation change
        can capture it live. Best effort: never fails the ADD."""
        path = req.netns
        if not path or self.uninstalling:
            return
        try:
            self.dataplane.check_netns(path)
            ident = self.dataplane.identity(path)
            if ident in self.dataplane.host_identities():
                return
            self.store.put_seen(seen_from_add(req, pod, list(ident)))
        except (NetnsError, OSError) as e:
            log.info("ADD %s: not remembered for live enrollment: %s", pod.key, e)

    def enroll(self, container_id: str) -> bool:
        """Capture a running pod that went through ADD uncaptured, now that it is to be
        captured: the same checks, order and fail-closed steps as ADD. True when captured."""
        with self._pod_lock(container_id):
            seen = self.store.get_seen(container_id)
            if seen is None or self.store.get(container_id) is not None:
                return False
            try:
                ident = self.dataplane.identity(seen.kubelet_netns)
            except OSError:
                ident = None
            if ident is None or list(ident) != list(seen.netns_id):
                log.info("%s: netns %s is gone or no longer the pod's: forgotten", seen.key,
                         seen.kubelet_netns)
                self.store.remove_seen(container_id)
                return False
            return self._enroll_live(
                container_id, seen.kubelet_netns, seen.ifname, list(seen.ips),
                seen.redirect_all_default, seen.namespace, seen.name, seen.uid,
                "captured while running")

    def enroll_discovered(self, pod: PodMeta, netns: str, container_id: str,
                          redirect_all_default: bool) -> bool:
        """Capture a running pod no ADD of ours saw (older than aether here), found by its IP
        in `netns`. Its kubelet DEL, under the real container id, is matched by netns."""
        if not request_mod.CONTAINER_ID.match(container_id):
            return False
        with self._pod_lock(container_id):
            if self.store.get(container_id) is not None:
                return False
            captured = self._enroll_live(
                container_id, netns, "eth0", list(pod.ips), redirect_all_default,
                pod.namespace, pod.name, pod.uid, f"found by its IP in {netns}, it started "
                "before aether")
            self.store.remove_seen(container_id)  # never remember a synthetic id
            return captured

    def _enroll_live(self, container_id: str, netns: str, ifname: str, ips: list[str],
                     redirect_all_default: bool, namespace: str, name: str, uid: str,
                     how: str) -> bool:
        """ADD's own path for a running pod (the caller holds its lock)."""
        req = CniRequest("ADD", ContainerId(container_id), netns=netns, ifname=ifname,
                         ips=tuple(ips),
                         netconf={"capture_redirect_all_default": redirect_all_default},
                         args={"K8S_POD_NAMESPACE": namespace, "K8S_POD_NAME": name,
                               "K8S_POD_UID": uid})
        fields = {"pod": name, "namespace": namespace}
        try:
            captured = self._add(req)
        except CniFailure as e:
            self.counters.add_failed += 1
            log.error("live enrollment of %s/%s (%s) failed: %s (%s); it stays uncaptured and "
                      "is tried again", namespace, name, how, e.msg, e.details, extra=fields)
            return False
        if captured:
            record = self.store.get(container_id)
            if record is not None:
                record.enrolled_live = True
                self.store.put(record)
            self.counters.enrolled += 1
            log.info("%s/%s enrolled live (%s): new connections go through the proxy, open "
                     "ones finish directly", namespace, name, how, extra=fields)
        return captured

    def release(self, container_id: str, why: str, remember: bool = True) -> bool:
        """Release a captured, running pod (no longer to be captured). Its table becomes an
        empty nat chain first, so new connections go direct at once while the ones open
        through the proxy keep their NAT translation; then the listener goes (Envoy closes
        those connections, and their close reaches the pod); `RELEASE_GRACE_S` later the table
        and the pin go (`finish_releases`). Remembered for re-enrollment."""
        with self._pod_lock(container_id):
            record = self.store.get(container_id)
            if record is None:
                return False
            try:
                ident: list[int] = list(self.dataplane.identity(record.netns))
            except OSError:
                ident = []
            try:
                self.dataplane.apply(record.netns, render_releasing())
                pending = True
            except DATAPLANE_ERRORS as e:
                log.warning("releasing %s: %s; dropping its table at once", record.key, e)
                try:
                    self._drop_table(record.netns)
                except CniFailure as gone:  # neither: it stays captured, tried again later
                    log.error("releasing %s: cannot change its table either (%s: %s); it "
                              "stays captured", record.key, gone.msg, gone.details)
                    return False
                pending = False
            try:
                self.sink.remove_pod(record)
            except Exception as e:  # noqa: BLE001 - no redirect any more: traffic flows
                log.error("releasing %s: listener removal failed: %s", record.key, e)
            if pending:
                with self._releasing_guard:
                    self._releasing[container_id] = (
                        time.monotonic() + RELEASE_GRACE_S, record.netns, record.pinned)
                self._start_finisher()
            elif record.pinned:
                try:
                    self.dataplane.unpin(record.netns)
                except OSError as e:
                    log.error("releasing %s: unpin %s: %s", record.key, record.netns, e)
            self.store.remove(container_id)
            if remember and ident and record.kubelet_netns:
                try:
                    now = list(self.dataplane.identity(record.kubelet_netns))
                except OSError:
                    now = []
                if now == ident:
                    self.store.put_seen(seen_from_release(container_id, record, ident))
            if self.on_released is not None:
                try:
                    self.on_released(record)
                except Exception:
                    log.exception("unregistering %s from the mesh model failed", record.key)
            self.counters.released += 1
            log.info("%s released (%s): new connections flow directly; the ones open "
                     "through the proxy are closed when its listener has drained", record.key, why,
                     extra={"pod": record.name, "namespace": record.namespace})
            return True

    def _start_finisher(self) -> None:
        with self._releasing_guard:
            if self._finisher is None or not self._finisher.is_alive():
                self._finisher = threading.Thread(target=self._finish_loop, name="release-finish",
                                                  daemon=True)
                self._finisher.start()

    def _finish_loop(self) -> None:
        while True:
            with self._releasing_guard:
                if not self._releasing:
                    self._finisher = None
                    return
                due = min(d for d, _, _ in self._releasing.values())
            time.sleep(max(0.0, min(0.5, due - time.monotonic())))
            self.finish_releases(wait=False)

    def finish_releases(self, wait: bool) -> None:
        """Drop the releasing tables (and pins) whose grace is over; with ``wait``, all of
        them, after waiting out their grace (uninstall, before the agent exits)."""
        with self._releasing_guard:
            entries = dict(self._releasing)
        for cid, (due, netns, pinned) in sorted(entries.items(), key=lambda kv: kv[1][0]):
            now = time.monotonic()
            if due > now:
                if not wait:
                    continue
                time.sleep(due - now)
            with self._pod_lock(cid):
                with self._releasing_guard:
                    if self._releasing.get(cid, (None,))[0] != due:
                        continue  # finished already, or released again since
                    del self._releasing[cid]
                if self.store.get(cid) is not None:
                    continue  # captured again meanwhile: its table and pin are in use
                try:
                    self._drop_table(netns)
                except CniFailure as e:
                    log.error("dropping the releasing table in %s: %s (%s)", netns, e.msg,
                              e.details)
                if pinned and os.path.lexists(netns):
                    try:
                        self.dataplane.unpin(netns)
                    except OSError as e:
                        log.error("unpinning %s after its release: %s", netns, e)

    def releases_pending(self) -> int:
        with self._releasing_guard:
            return len(self._releasing)

    def reapply(self, container_id: str, policy: Any, reason: str) -> bool:
        """A captured pod's exclusions changed: re-program its table in place (one atomic
        transaction, so no packet sees a half-updated table)."""
        return self.update_policy(container_id, lambda _: policy, reason)

    def update_policy(self, container_id: str,
                      change: Callable[[CapturePolicy], CapturePolicy],
                      reason: str | None = None) -> bool:
        """Re-program a recorded pod's table with ``change(its policy)``, under its CNI lock:
        a pod deleted meanwhile stays deleted, a policy changed meanwhile is the one changed.
        ``reason`` replaces the recorded one (None: kept)."""
        with self._pod_lock(container_id):
            record = self.store.get(container_id)
            if record is None:
                return False
            policy = change(record.policy)
            if policy == record.policy:
                return False
            reason = record.reason if reason is None else reason
            # what the new rules redirect to is up before them (the pod DNS when its capture
            # turns on), what they stop redirecting to goes after them
            changing = getattr(self.sink, "policy_changing", None)
            changed = getattr(self.sink, "policy_changed", None)
            if callable(changing):
                try:
                    changing(record, policy)
                except Exception as e:  # noqa: BLE001 - the previous rules stay, consistent
                    log.error("re-applying the capture of %s: %s; the previous rules stay",
                              record.key, e)
                    return False
            try:
                fp = self.dataplane.apply(record.netns, render_ruleset(policy))
            except DATAPLANE_ERRORS as e:
                log.error("re-applying the capture of %s failed: %s; the previous rules stay",
                          record.key, e)
                if callable(changed):
                    changed(record, record.policy)  # back to what the old rules need
                return False
            if callable(changed):
                changed(record, policy)
            record.policy, record.fingerprint, record.reason = policy, fp, reason
            self.store.put(record)
            self.counters.reapplied += 1
            log.info("%s: capture rules updated in place (%s)", record.key, reason,
                     extra={"pod": record.name, "namespace": record.namespace})
            return True

    # -- DEL -----------------------------------------------------------------------------
    def _del(self, req: CniRequest) -> None:
        self.store.remove_seen(req.container_id)
        record = self.store.get(req.container_id)
        if record is None:
            found = self._owners.discovered_for(req)
            if found is not None:  # kubelet's DEL of a pod found by its IP: release it
                with self._pod_lock(found.container_id):
                    self._del(req.but(container_id=ContainerId(found.container_id),
                                      netns=found.netns))
                return
            # Not ours (or already cleaned): still drop a table and a pin a crashed ADD may
            # have left behind, but only in a netns no record owns and never the node's own.
            cid = req.container_id
            if req.netns and self._unowned(req.netns, cid):
                self._drop_table(req.netns)
            # A leftover pin that is no longer a namespace (its mount is gone) is just removed.
            orphan = os.path.join(self.node.run_dir, "netns", cid)
            if os.path.lexists(orphan):
                if self._unowned(orphan, cid):
                    self._drop_table(orphan)
                self._release_pin(orphan, True)
            self.store.end_add(cid)
            self.counters.del_ok += 1
            return
        try:
            self.sink.remove_pod(record)
        except Exception as e:
            raise CniFailure(p.ERR_TRY_AGAIN, f"removing the listener of {record.key} failed",
                             str(e)) from e
        self._drop_table(record.netns)
        if record.pinned and record.kubelet_netns and self._stale(record.netns) \
                and self._unowned(record.kubelet_netns, record.container_id):
            self._drop_table(record.kubelet_netns)  # the pin's mount is gone, the netns may not be
        if record.pinned:
            try:
                self.dataplane.unpin(record.netns)
            except OSError as e:
                raise CniFailure(p.ERR_TRY_AGAIN, f"unpinning netns of {record.key}", str(e)) from e
        self.store.remove(record.container_id)
        if self.on_released is not None:
            try:
                self.on_released(record)
            except Exception:
                log.exception("unregistering %s from the mesh model failed", record.key)
        self.counters.del_ok += 1
        log.info("DEL %s: capture removed", record.key,
                 extra={"pod": record.name, "namespace": record.namespace})

    def _unowned(self, netns: str, cid: str) -> bool:
        """May a DEL for unknown container `cid` clean `netns`? Not the node's own netns, not a
        netns another container's record (or an ADD in progress) owns."""
        return self._owners.unowned(netns, cid)

    def _drop_table(self, netns: str) -> None:
        try:
            self.dataplane.drop(netns)
        except NetnsGone:
            pass  # the namespace is gone and its rules with it
        except DATAPLANE_ERRORS as e:
            if not os.path.exists(netns):
                return
            if self._stale(netns):  # not a namespace (a pin whose mount is gone): no table there
                log.info("%s is not a network namespace (%s): no capture table to remove",
                         netns, e)
                return
            raise CniFailure(p.ERR_TRY_AGAIN, f"removing capture rules from {netns}", str(e)) from e

    # -- CHECK ---------------------------------------------------------------------------
    def _check(self, req: CniRequest) -> None:
        record = self.store.get(req.container_id)
        if record is None:
            self._check_uncaptured(req)
            self.counters.check_ok += 1
            return
        if req.netns:
            try:
                mismatch = self.dataplane.identity(req.netns) != self.dataplane.identity(record.netns)
            except OSError:
                mismatch = False  # one of them is gone: the table check below tells
            if mismatch:
                raise CniFailure(
                    p.ERR_CHECK_DRIFT,
                    f"{record.key} was captured in {record.netns}, which is not its netns "
                    f"{req.netns}",
                )
        try:
            live = self.dataplane.live_fingerprint(record.netns)
        except DATAPLANE_ERRORS as e:
            raise CniFailure(p.ERR_CHECK_DRIFT, f"cannot read capture rules of {record.key}",
                             str(e)) from e
        if live is None:
            raise CniFailure(p.ERR_CHECK_DRIFT, f"capture table missing in the netns of {record.key}")
        if live != record.fingerprint:
            raise CniFailure(
                p.ERR_CHECK_DRIFT,
                f"capture rules of {record.key} differ from what the agent programmed",
                "the aether table was modified outside the agent",
            )
        self.counters.check_ok += 1

    def strict_node(self, max_age: float = 1.0) -> NodeConfig:
        """The node config with its current addresses, what STRICT policies are decided on."""
        from agent.netns.addresses import current
        return dataclasses.replace(self.node, node_addresses=current(max_age))

    def _check_uncaptured(self, req: CniRequest) -> None:
        """CHECK of a container without a record: fine unless policy says it is captured."""
        looked = self._lookup(req.args)
        if looked is None:
            return
        pod, namespace = looked
        decision = decide(pod, namespace, self.node, self._redirect_all_default(req.netconf))
        if decision.captured:
            raise CniFailure(
                p.ERR_CHECK_DRIFT,
                f"{pod.key} is to be captured ({decision.reason}) but the agent has no capture "
                f"for container {req.container_id}: its traffic bypasses the mesh",
            )


def _fault(point: str) -> None:
    """Fault injection for the crash-consistency tests (AETHER_FAULT=<point>): die here."""
    if os.environ.get("AETHER_FAULT") == point:
        log.error("fault injection: exiting at %s", point)
        os._exit(70)
