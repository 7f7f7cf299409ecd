"""The running agent: wires source, state, CNI handler, sockets and (optionally) Envoy.

Startup reconciles before serving: captured pods whose netns is gone are dropped, drifted
tables are re-programmed from the recorded policy, and live pods are handed back to the
listener sink, so a restart never leaves a captured pod without its rules or listener.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from agent import __version__
from agent.capture.rules import render_ruleset
from agent.cni.handler import CniHandler, ListenerSink, NullSink
from agent.cni import request as cni_request
from agent.cni.server import UnixJsonServer, json_handler
from agent.config import NodeConfig
from agent.netns import nft
from agent.netns.enter import NetnsError, check_netns_path
from agent.netns.pin import unpin
from agent.source.base import MetadataSource
from agent.state import StateStore

log = logging.getLogger("aether.agent")


class Agent:
    def __init__(
        self, node: NodeConfig, source: MetadataSource, sink: ListenerSink | None = None
    ) -> None:
        self.node = node
        self.source = source
        self.sink: ListenerSink = sink or NullSink()
        os.makedirs(node.run_dir, mode=0o755, exist_ok=True)
        self.store = StateStore(os.path.join(node.run_dir, "pods"))
        self.handler = CniHandler(node, source, self.store, self.sink)
        too_large = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 103, '
                                        '"msg": "request larger than 1 MiB rejected"}'))
        self.cni_server = UnixJsonServer(node.cni_socket, self.handler.handle_raw, "cni",
                                         oversize_answer=too_large)
        self.status_server = UnixJsonServer(
            os.path.join(node.run_dir, "status.sock"), json_handler(self._status_request), "status"
        )
        self.started_at = time.time()
        self.reconcile_report: list[str] = []
        self.stopped = threading.Event()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.store.load()
        if self.store.load_problem:
            self.reconcile_report.append(self.store.load_problem)
        live = [p for p in self.store.all() if os.path.exists(p.netns)]
        preload = getattr(self.sink, "preload", None)
        if callable(preload):
            preload(live)
        start = getattr(self.sink, "start", None)
        if callable(start):
            start()
        self.reconcile()
        self.cni_server.start()
        self.status_server.start()
        log.info("aether-agent %s ready on node %s (source: %s)", __version__,
                 self.node.node_name, self.source.describe())

    def stop(self) -> None:
        self.cni_server.stop()
        self.status_server.stop()
        stop = getattr(self.sink, "stop", None)
        if callable(stop):
            stop()
        self.stopped.set()

    def reconcile(self) -> None:
        """Bring recorded pods back to their recorded capture (or forget them if dead)."""
        for pod in self.store.all():
            try:
                check_netns_path(pod.netns)
            except NetnsError as e:
                self._note(f"{pod.key}: netns {pod.netns} gone ({e}); dropped from state")
                if pod.pinned:
                    try:
                        unpin(pod.netns)
                    except OSError as err:
                        self._note(f"{pod.key}: unpin failed: {err}")
                try:
                    self.sink.remove_pod(pod)
                except Exception as err:  # noqa: BLE001
                    self._note(f"{pod.key}: listener removal failed: {err}")
                self.store.remove(pod.container_id)
                continue
            try:
                live = nft.live_fingerprint(pod.netns)
                if live != pod.fingerprint:
                    pod.fingerprint = nft.apply_ruleset(pod.netns, render_ruleset(pod.policy))
                    self.store.put(pod)
                    self._note(f"{pod.key}: capture table {'missing' if live is None else 'drifted'};"
                               " re-programmed")
            except (nft.NftError, NetnsError, OSError, TimeoutError) as e:
                self._note(f"{pod.key}: re-programming failed: {e}")
            try:
                self.sink.add_pod(pod)
            except Exception as e:  # noqa: BLE001
                self._note(f"{pod.key}: listener not restored: {e}")
        log.info("reconciled %d captured pods", len(self.store.all()))

    def _note(self, msg: str) -> None:
        log.warning("reconcile: %s", msg)
        self.reconcile_report.append(msg)

    # -- status --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        c = self.handler.counters
        pods = []
        for pod in sorted(self.store.all(), key=lambda x: x.key):
            try:
                live = nft.live_fingerprint(pod.netns)
                verified = "ok" if live == pod.fingerprint else ("missing" if live is None else "drift")
            except (NetnsError, nft.NftError, OSError, TimeoutError) as e:
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
            })
        out: dict[str, Any] = {
            "version": __version__,
            "node": self.node.node_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "source": self.source.describe(),
            "run_dir": self.node.run_dir,
            "counters": vars(c).copy(),
            "pods": pods,
            "warnings": list(self.handler.recent_problems),
            "reconcile": list(self.reconcile_report),
        }
        extra = getattr(self.sink, "status", None)
        if callable(extra):
            out["envoy"] = extra()
        out["degraded"] = any(p["rules"] != "ok" for p in pods) or bool(
            out.get("envoy", {}).get("degraded")
        )
        return out

    def _status_request(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or request.get("command") != "status":
            return {"ok": False, "msg": "expected {\"command\": \"status\"}"}
        return {"ok": True, "status": self.status()}
