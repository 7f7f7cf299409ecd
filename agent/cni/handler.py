"""The agent side of a CNI request: the shim's envelope in, one answer out (STATUS and GC of
CNI 1.1 included); what the request does to the pod is the capture lifecycle's
(agent.cni.lifecycle, which CniHandler is).

Every path either completes or leaves the pod failing ADD (fail closed): rules go in as one
atomic transaction, the state record is written only after the kernel holds the table, and
ADD returns only after the listener sink (Envoy) confirms the pod's listener is live.

The names other modules import from here stay here: the lifecycle's constants, the listener
sink, the counters and the CNI message types are re-exported from the modules holding them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from agent.cni import protocol as p
from agent.cni import request as request_mod
from agent.cni.lifecycle import RELEASE_GRACE_S, CaptureLifecycle
from agent.cni.listener_sink import ListenerSink, NullSink
from agent.cni.messages import CniAnswer, CniFailure, CniRequest
from agent.cni.reporting import REASON_INVALID_ANNOTATION, Counters
from agent.common.ids import ContainerId

__all__ = [
    "REASON_INVALID_ANNOTATION",
    "RELEASE_GRACE_S",
    "CaptureLifecycle",
    "CniAnswer",
    "CniFailure",
    "CniHandler",
    "CniRequest",
    "Counters",
    "ListenerSink",
    "NullSink",
]

log = logging.getLogger("aether.cni")


class CniHandler(CaptureLifecycle):
    """The CNI socket's handler: each request, under its container's lock, becomes a step of
    the capture lifecycle, and every outcome an answer (never an exception, never a hang)."""

    # -- entry points --------------------------------------------------------------------
    def handle_raw(self, data: bytes) -> bytes:
        """The CNI socket: the shim's envelope in, `<exit code>\n<stdout>` out."""
        try:
            envelope = json.loads(data)
        except ValueError as e:
            return request_mod.encode((1, json.dumps(request_mod.cni_error(
                p.ERR_DECODE, "failed to decode the request from aether-cni "
                "(is the network configuration valid JSON?)", str(e)))))
        try:
            early, req = request_mod.parse(envelope)
            if early is not None:
                return request_mod.encode(early)
            return request_mod.encode(request_mod.render(req, self.handle(req)))
        except Exception as e:  # malformed input must get an answer, never a closed socket
            log.exception("malformed CNI request")
            return request_mod.encode((1, json.dumps(request_mod.cni_error(
                p.ERR_BAD_REQUEST, "malformed request from aether-cni", repr(e)))))

    def handle(self, request: Any) -> dict[str, Any]:
        """One request from the shim → its answer in wire form (``CniAnswer.to_json``)."""
        return self.answer(request).to_json()

    def answer(self, request: Any) -> CniAnswer:
        """One request from the shim → one typed answer; never raises."""
        started = time.monotonic()
        command = request.get("command") if isinstance(request, dict) else None
        outcome = "failed"
        try:
            if command in ("STATUS", "GC") and isinstance(request, dict):
                if command == "STATUS":
                    self._status()
                else:
                    self._gc(request.get("netconf") or {})
                return CniAnswer(True)
            req = request_mod.to_request(request)
            with self._pod_lock(req.container_id):
                if req.command == "ADD":
                    outcome = "ok" if self._add(req) else "skipped"
                elif req.command == "DEL":
                    self._del(req)
                    outcome = "ok"
                else:
                    self._check(req)
                    outcome = "ok"
            return CniAnswer(True)
        except CniFailure as e:
            if command == "ADD":
                self.counters.add_failed += 1
            elif command == "CHECK":
                self.counters.check_failed += 1
            log.error("CNI %s failed: %s (%s)", command, e.msg, e.details,
                      extra={"container_id": _cid(request)})
            return CniAnswer(False, e.code, e.msg, e.details)
        except Exception as e:  # a bug must still answer the shim, never hang it
            log.exception("CNI %s crashed", command)
            if command == "ADD":
                self.counters.add_failed += 1
            return CniAnswer(False, p.ERR_CAPTURE_FAILED,
                             f"aether agent internal error on {command}", repr(e))
        finally:
            took = time.monotonic() - started
            log.debug("CNI %s took %.1f ms", command, took * 1000)
            if self.metrics is not None:
                self.metrics.observe_cni(command, took, outcome)

    # -- STATUS and GC (CNI 1.1) ----------------------------------------------------------
    def _status(self) -> None:
        """Ready for ADDs: the agent answers (it does, here) and its proxy is ready."""
        ready = getattr(self.sink, "ready", None)
        if callable(ready) and not ready():
            raise CniFailure(p.ERR_PLUGIN_NOT_AVAILABLE,
                             "aether's node proxy (Envoy) is not ready: pods cannot be captured "
                             "yet", "see `aether-agent status`")

    def _gc(self, netconf: dict[str, Any]) -> None:
        """Release every capture whose attachment is not in `cni.dev/valid-attachments`
        (rules where the netns still exists, listener, pin, record), as its DEL would."""
        valid = netconf.get("cni.dev/valid-attachments")
        if not isinstance(valid, list):
            raise CniFailure(p.ERR_INVALID_NETCONF, "GC needs cni.dev/valid-attachments (a list)")
        keep = {(str(a.get("containerID", "")), str(a.get("ifname", "")))
                for a in valid if isinstance(a, dict)}
        keep_ids = {cid for cid, _ in keep}
        for seen in self.store.all_seen():
            if (seen.container_id, seen.ifname) not in keep and seen.container_id not in keep_ids:
                self.store.remove_seen(seen.container_id)
        for record in self.store.all():
            if (record.container_id, record.ifname) in keep or (
                    not record.ifname and record.container_id in keep_ids):
                continue
            log.info("GC: %s (container %s) is not a valid attachment: releasing its capture",
                     record.key, record.container_id)
            with self._pod_lock(record.container_id):
                self._del(CniRequest("DEL", ContainerId(record.container_id),
                                     netns=record.kubelet_netns, ifname=record.ifname,
                                     netconf=netconf))


def _cid(request: Any) -> str:
    return str(request.get("container_id", "")) if isinstance(request, dict) else ""
