"""Undo what an agent that died in the middle of an ADD left behind (run at start).

An ADD goes intent → pin → rules → record → listener. Once the record exists the capture is
the restarted agent's to complete (reconcile re-programs the table and re-serves the
listener). Before it, nothing but the intent (and the pin directory) says the ADD happened,
and kubelet saw the ADD fail — so the restarted agent undoes it: drops the table in that
netns and removes the pin. A table is only dropped in a netns that no record owns and that
is not the node's own (the rule DEL follows too); a pin that is no longer a namespace (its
mount went away with the agent's mount namespace, or the agent died between creating the
file and mounting it) is just removed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from agent.cni.state import StateStore
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane, NftDataplane
from agent.netns.enter import NetnsGone

log = logging.getLogger("aether.recovery")


def recover_interrupted_adds(store: StateStore, pin_dir: str, note: Callable[[str], None],
                             dataplane: CaptureDataplane | None = None) -> None:
    """Complete or undo every ADD a crash interrupted; `note` reports each action."""
    dp = dataplane or NftDataplane()
    recorded = {p.container_id for p in store.all()}
    for intent in store.intents():
        cid = intent.container_id
        if cid in recorded:  # the record was written: reconcile completes the capture
            store.end_add(cid)
            continue
        target, pinned = intent.netns, intent.pinned
        if not target:  # an unreadable intent: its pin, if any, is still found by its name
            target = os.path.join(pin_dir, cid)
            pinned = os.path.lexists(target)
        done = undo(store, cid, target, pinned, intent.kubelet_netns, note, dp)
        if done:
            store.end_add(cid)
    pinned_paths = {os.path.realpath(p.netns) for p in store.all() if p.pinned}
    try:
        names = sorted(os.listdir(pin_dir))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    for name in names:
        path = os.path.join(pin_dir, name)
        if os.path.realpath(path) not in pinned_paths:  # a pin no record accounts for
            undo(store, name, path, True, "", note, dp)


def undo(store: StateStore, cid: str, target: str, pinned: bool, kubelet_netns: str,
         note: Callable[[str], None], dataplane: CaptureDataplane | None = None) -> bool:
    """Drop the aether table an unrecorded ADD of `cid` put in `target` and remove its pin.
    True when nothing of that ADD is left."""
    dp = dataplane or NftDataplane()
    what: list[str] = []
    ok = True
    state = dp.netns_state(target) if target else "missing"
    reach = target if state == "netns" else ""
    if not reach and pinned and kubelet_netns and dp.netns_state(kubelet_netns) == "netns":
        reach = kubelet_netns  # the pin's mount is gone; the table may still be in the netns
    if reach:
        why = _not_ours(store, reach, dp)
        if why:
            what.append(f"table in {reach} left alone ({why})")
        else:
            try:
                if dp.drop(reach):
                    what.append(f"table dropped in {reach}")
            except NetnsGone:
                pass
            except DATAPLANE_ERRORS as e:
                what.append(f"dropping the table in {reach} failed: {e}")
                ok = False
    if pinned and os.path.lexists(target):
        try:
            dp.unpin(target)
            what.append(f"pin {target} removed" + (" (no longer a namespace)"
                                                   if state == "stale" else ""))
        except OSError as e:
            what.append(f"removing pin {target} failed: {e}")
            ok = False
    if what:
        note(f"container {cid}: ADD interrupted before its record; " + "; ".join(what))
    return ok


def _not_ours(store: StateStore, netns: str, dp: CaptureDataplane) -> str:
    """Why a table in `netns` must not be dropped ('' when it may): the node's own netns, or
    one a record owns."""
    try:
        ident = dp.identity(netns)
    except OSError as e:
        return f"cannot identify it: {e.strerror}"
    if ident in dp.host_identities():
        return "the node's own network namespace"
    owner = store.netns_owner(ident, dp.identity)
    if owner is not None:
        return f"captured for {owner.key} (container {owner.container_id})"
    return ""
