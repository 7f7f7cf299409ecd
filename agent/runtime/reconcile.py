"""The recorded pods against the node: reconcile at start, and release them all.

Split out of ``agent.runtime.app`` (the composition). At start (after
``agent.runtime.recovery`` has undone the ADDs a crash cut short), each recorded pod whose
sandbox is gone is dropped, a drifted or missing table is re-programmed from its recorded
policy, a lost netns pin is re-made, and the pod's listener is handed back to the sink; an
empty table a live release left behind is dropped. On uninstall, or our DaemonSet deleted,
every captured pod is released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.capture.policy import with_node_proxies
from agent.capture.rules import render_ruleset
from agent.cni.handler import CniHandler, ListenerSink
from agent.cni.state import CapturedPod, StateStore
from agent.common.config import NodeConfig
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane
from agent.netns.enter import NetnsError
from agent.runtime.options import AgentOptions

log = logging.getLogger("aether.agent")

Note = Callable[[str], None]  # a line of the reconcile report (and a warning)


def reconcile(store: StateStore, dataplane: CaptureDataplane, sink: ListenerSink,
              node: NodeConfig, note: Note) -> None:
    """Bring recorded pods back to their recorded capture (or forget them if dead)."""
    for pod in store.all():
        gone = pod_gone(pod, dataplane, note)
        if gone:
            note(f"{pod.key}: netns {pod.kubelet_netns} gone ({gone}); dropped from state")
            if pod.pinned:
                try:
                    dataplane.unpin(pod.netns)
                except OSError as err:
                    note(f"{pod.key}: unpin failed: {err}")
            try:
                sink.remove_pod(pod)
            except Exception as err:  # noqa: BLE001
                note(f"{pod.key}: listener removal failed: {err}")
            store.remove(pod.container_id)
            continue
        try:
            live = dataplane.live_fingerprint(pod.netns)
            # this agent's proxy cgroup (and a take-over peer's) in place of the writer's
            want = with_node_proxies(pod.policy, node)
            drifted, moved = live != pod.fingerprint, want != pod.policy
            if drifted or moved:
                pod.fingerprint = dataplane.apply(pod.netns, render_ruleset(want))
                pod.policy = want
                store.put(pod)
                if drifted:
                    note(f"{pod.key}: capture table "
                         f"{'missing' if live is None else 'drifted'}; re-programmed")
                else:
                    log.info("%s: table re-programmed for this agent's proxy cgroup(s)",
                             pod.key)
        except DATAPLANE_ERRORS as e:
            note(f"{pod.key}: re-programming failed: {e}")
        try:
            restore = getattr(sink, "restore_pod", sink.add_pod)
            restore(pod)
        except Exception as e:  # noqa: BLE001
            note(f"{pod.key}: listener not restored: {e}")
    log.info("reconciled %d captured pods", len(store.all()))


def drop_leftover_release_tables(store: StateStore, dataplane: CaptureDataplane,
                                 note: Note) -> None:
    """A pod released live keeps an empty table for a few seconds; an agent that died in
    them left it behind. An uncaptured pod never holds one: drop it."""
    for seen in store.all_seen():
        try:
            if list(dataplane.identity(seen.kubelet_netns)) != list(seen.netns_id):
                continue
            if dataplane.listing(seen.kubelet_netns) is not None:
                dataplane.drop(seen.kubelet_netns)
                note(f"{seen.key}: dropped the table left from its release")
        except DATAPLANE_ERRORS as e:
            note(f"{seen.key}: checking for a table left from its release: {e}")


def pod_gone(pod: CapturedPod, dataplane: CaptureDataplane, note: Note) -> str:
    """Why the pod's sandbox is gone ('' if it lives). A pin keeps its netns alive, so a
    pinned pod is judged by kubelet's own path (/proc/<pid>/ns/net: the sandbox process);
    a lost pin (e.g. the agent's mounts did not survive) is re-made when that path still
    holds the netns with our table in it."""
    if not pod.pinned:
        try:
            dataplane.check_netns(pod.netns)
            return ""
        except NetnsError as e:
            return str(e)
    try:
        dataplane.check_netns(pod.kubelet_netns)
    except NetnsError as e:
        return f"sandbox process gone: {e}"
    if dataplane.netns_state(pod.netns) == "netns":  # the pin holds
        same = dataplane.identity(pod.netns) == dataplane.identity(pod.kubelet_netns)
        return "" if same else "the sandbox pid now belongs to another netns"
    try:
        live = dataplane.live_fingerprint(pod.kubelet_netns)
    except DATAPLANE_ERRORS as e:
        return f"pin lost and netns unreadable: {e}"
    if live is None:
        return "pin lost and the kubelet path holds no aether table"
    try:
        dataplane.pin(pod.kubelet_netns, pod.netns)
    except OSError as e:
        return f"pin lost and could not be re-made: {e}"
    note(f"{pod.key}: netns pin was lost; re-pinned from {pod.kubelet_netns}")
    return ""


def release_all(handler: CniHandler, store: StateStore, why: str) -> dict[str, Any]:
    """Release every captured pod (live enrollment already stopped): each pod's table then
    its listener, and nothing remembered."""
    records = sorted(store.all(), key=lambda r: r.key)
    log.warning("%s: releasing all %d captured pods; their traffic flows directly from "
                "now on", why, len(records))
    released: list[str] = []
    failed: list[str] = []
    for i, rec in enumerate(records, 1):
        ok = handler.release(rec.container_id, why, remember=False)
        (released if ok else failed).append(rec.key)
        log.info("[%d/%d] %s %s", i, len(records), rec.key, "released" if ok else "FAILED")
    for seen in store.all_seen():
        store.remove_seen(seen.container_id)
    handler.finish_releases(wait=True)  # Envoy closed their connections: tables go
    failed += [r.key for r in store.all()]  # a release that could not drop its table
    return {"released": released, "failed": failed}


def await_plugin_removed(options: AgentOptions, wait_s: float) -> None:
    """Our DaemonSet is being deleted: wait (up to ``wait_s``) for `cni-install` to take
    aether-cni out of the CNI config, so no new pod is captured once the pods go."""
    from agent.node.readiness import plugin_installed
    o = options
    deadline = time.monotonic() + wait_s
    while plugin_installed(o.cni_conf_dir, o.cni_bin_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    if plugin_installed(o.cni_conf_dir, o.cni_bin_dir):
        log.error("our DaemonSet is being deleted but aether-cni is still in the CNI config "
                  "after %.0fs: releasing the pods anyway (new pods fail ADD until the "
                  "entry goes)", wait_s)
