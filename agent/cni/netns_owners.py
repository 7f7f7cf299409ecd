"""Who a pod's network namespace belongs to, asked before the capture lifecycle touches one:
the netns an ADD names must be a namespace and not the node's own; an ADD claims it for the
length of its steps and is refused one that another container id's record or ADD in progress
owns; a DEL for an unknown container cleans only a netns nobody owns; a kubelet DEL finds the
record of a pod enrolled by its IP (synthetic container id) by netns or uid."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from agent.cni import codes as p
from agent.cni.messages import CniFailure, CniRequest
from agent.cni.state import CapturedPod, StateStore
from agent.netns.dataplane import CaptureDataplane
from agent.netns.enter import NetnsError, NetnsId

log = logging.getLogger("aether.cni")


class NetnsOwners:
    """The netns claims of the ADDs in progress, checked with the owners the records name."""

    def __init__(self, store: StateStore, dataplane: CaptureDataplane) -> None:
        self.store = store
        self.dataplane = dataplane
        # netns identity → container id of an ADD in progress: two container ids racing into
        # one namespace see each other before either has a record
        self.claims: dict[NetnsId, str] = {}
        self.guard = threading.Lock()

    def pod_netns(self, key: str, kubelet_netns: str) -> NetnsId:
        """The identity of the netns the ADD of `key` names: a namespace, not the node's own."""
        try:
            self.dataplane.check_netns(kubelet_netns)
            ident = self.dataplane.identity(kubelet_netns)
        except NetnsError as e:
            raise CniFailure(p.ERR_INVALID_ENV, f"cannot capture {key}: {e}") from e
        except OSError as e:
            raise CniFailure(p.ERR_INVALID_ENV, f"cannot capture {key}: netns "
                             f"{kubelet_netns}: {e.strerror}") from e
        if ident in self.dataplane.host_identities():
            raise CniFailure(
                p.ERR_INVALID_ENV,
                f"refusing to capture {key}: netns {kubelet_netns} is the node's own network "
                "namespace (the agent's or pid 1's), not a pod's",
            )
        return ident

    @contextmanager
    def claim(self, ident: NetnsId, cid: str, key: str, path: str) -> Iterator[None]:
        """Hold `ident` for container `cid`; refuse a netns another container id owns."""
        with self.guard:
            owner = self.store.netns_owner(ident, self.dataplane.identity, exclude=cid)
            if owner is not None:
                raise CniFailure(
                    p.ERR_INVALID_ENV,
                    f"refusing to capture {key} (container {cid}): netns {path} is already "
                    f"captured for {owner.key} (container {owner.container_id})",
                )
            other = self.claims.get(ident)
            if other is not None and other != cid:
                raise CniFailure(
                    p.ERR_INVALID_ENV,
                    f"refusing to capture {key} (container {cid}): netns {path} is being "
                    f"captured for container {other}",
                )
            self.claims[ident] = cid
        try:
            yield
        finally:
            with self.guard:
                if self.claims.get(ident) == cid:
                    del self.claims[ident]

    def unowned(self, netns: str, cid: str) -> bool:
        """May a DEL for unknown container `cid` clean `netns`? Not the node's own netns, not a
        netns another container's record (or an ADD in progress) owns."""
        try:
            ident = self.dataplane.identity(netns)
        except OSError:
            return True  # gone or unreachable: nothing of anyone's to protect there
        if ident in self.dataplane.host_identities():
            log.warning("DEL %s: netns %s is the node's own network namespace: left alone",
                        cid, netns, extra={"container_id": cid})
            return False
        with self.guard:
            owner = self.store.netns_owner(ident, self.dataplane.identity, exclude=cid)
            claimed = self.claims.get(ident)
        if owner is not None or (claimed is not None and claimed != cid):
            who = owner.key + f" (container {owner.container_id})" if owner else f"container {claimed}"
            log.warning("DEL %s: unknown container; its netns %s is captured for %s: left alone",
                        cid, netns, who, extra={"container_id": cid})
            return False
        return True

    def discovered_for(self, req: CniRequest) -> CapturedPod | None:
        """The record of a pod enrolled by its IP (synthetic container id) that this DEL is
        for: same netns, or (netns already gone) the same pod uid."""
        uid = req.args.get("K8S_POD_UID", "")
        ident: NetnsId | None = None
        if req.netns:
            try:
                ident = self.dataplane.identity(req.netns)
            except OSError:
                ident = None
        for rec in self.store.all():
            if not rec.container_id.startswith("discovered-"):
                continue
            if uid and rec.uid == uid:
                return rec
            if ident is not None:
                try:
                    if self.dataplane.identity(rec.netns) == ident:
                        return rec
                except OSError:
                    continue
        return None
