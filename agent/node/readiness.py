"""The node taint that keeps pods off a node until capture works there.

Nodes register with `aether.io/agent-not-ready:NoSchedule` (kubelet `--register-with-taints`);
the agent lifts it once the plugin is installed, its socket serves and Envoy is ready, and
puts it back only when it shuts down for good (an upgrade restarts it on the same node).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt

from agent.install import conflist as cl
from agent.install.installer import read_configs
from agent.kube import done
from agent.kube.rest import CoreV1

log = logging.getLogger("aether.node")

TAINT_KEY = "aether.io/agent-not-ready"
TAINT_EFFECT = "NoSchedule"
TAINT = {"key": TAINT_KEY, "effect": TAINT_EFFECT}


def _ours(t: Any) -> bool:
    return isinstance(t, dict) and t.get("key") == TAINT_KEY and t.get("effect") == TAINT_EFFECT


def _conflict(e: BaseException) -> bool:
    return isinstance(e, ApiException) and e.status == 409


class NodeReadiness:
    """Add/remove our taint with a resourceVersion-guarded merge patch (retried on 409)."""

    def __init__(self, api: client.ApiClient | str | None, node_name: str,
                 timeout: float = 5.0, attempts: int = 5) -> None:
        if not isinstance(api, client.ApiClient):
            from agent.kube import api_client
            api = api_client(api)
        self.core = CoreV1(api)
        self.node_name = node_name
        self.timeout = timeout
        self.attempts = attempts

    def _node(self) -> dict[str, Any]:
        resp: Any = self.core.read_node(self.node_name, _preload_content=False,
                                        _request_timeout=(self.timeout, self.timeout))
        obj: dict[str, Any] = json.loads(resp.data)
        return obj

    def taints(self) -> list[dict[str, Any]]:
        return list((self._node().get("spec") or {}).get("taints") or [])

    def is_tainted(self) -> bool:
        return any(_ours(t) for t in self.taints())

    def _set(self, want: bool) -> bool:
        """Converge on tainted == want; True if the Node was patched. A 409 (someone else
        changed the Node since we read it) reads it again, ``attempts`` times in all."""
        try:
            for attempt in Retrying(stop=stop_after_attempt(self.attempts),
                                    retry=retry_if_exception(_conflict)):
                with attempt:
                    return self._set_once(want)
        except RetryError:
            raise RuntimeError(f"node {self.node_name}: taint update kept conflicting") from None
        raise AssertionError("unreachable: tenacity returns or raises")

    def _set_once(self, want: bool) -> bool:
        node = self._node()
        taints = list((node.get("spec") or {}).get("taints") or [])
        if any(_ours(t) for t in taints) == want:
            return False
        new = [t for t in taints if not _ours(t)] + ([dict(TAINT)] if want else [])
        body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": new}}
        resp: Any = self.core.patch_node(
            self.node_name, body, _content_type="application/merge-patch+json",
            _preload_content=False, _request_timeout=(self.timeout, self.timeout))
        done(resp)
        log.info("node %s: taint %s %s", self.node_name, TAINT_KEY, "added" if want else "removed")
        return True

    def mark_ready(self) -> bool:
        return self._set(False)

    def mark_not_ready(self) -> bool:
        return self._set(True)


# ---- readiness conditions ----------------------------------------------------------------

def plugin_installed(conf_dir: str, bin_dir: str) -> bool:
    """kubelet's config has our entry last and the shim is executable."""
    if not os.access(os.path.join(bin_dir, "aether-cni"), os.X_OK):
        return False
    files = read_configs(conf_dir)
    name = cl.select_config(files)
    if name is None:
        return False
    return cl.has_entry(cl.parse(files[name]))


def socket_serving(path: str, timeout: float = 1.0) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


class ReadinessLoop:
    """Poll the checks; lift the taint once all pass; `stop(for_good=True)` restores it."""

    def __init__(self, readiness: NodeReadiness, checks: dict[str, Callable[[], bool]],
                 interval: float = 1.0) -> None:
        self.readiness = readiness
        self.checks = checks
        self.interval = interval
        self.ready = False
        self.failing: list[str] = list(checks)
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> bool:
        failing = []
        for name, check in self.checks.items():
            try:
                ok = check()
            except Exception:  # noqa: BLE001 - a broken check is a failing check
                ok = False
            if not ok:
                failing.append(name)
        self.failing = failing
        if not failing and not self.ready:
            try:
                self.readiness.mark_ready()
                self.ready, self.error = True, ""
            except Exception as e:  # noqa: BLE001 - API trouble: retry next tick
                self.error = f"{type(e).__name__}: {e}"
                log.warning("could not remove taint %s: %s", TAINT_KEY, self.error)
        return self.ready

    def _run(self) -> None:
        while not self._stop.is_set() and not self.tick():
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-readiness", daemon=True)
        self._thread.start()

    def stop(self, for_good: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if for_good:
            with contextlib.suppress(Exception):
                self.readiness.mark_not_ready()

    def status(self) -> dict[str, Any]:
        return {"taint": TAINT_KEY, "ready": self.ready, "waiting_for": list(self.failing),
                "error": self.error}


def shutting_down_for_good(kubeconfig: str | None, namespace: str, daemonset: str) -> bool:
    """Our DaemonSet gone or being deleted: the node will have no agent, so re-taint."""
    from agent.install.kube import DaemonSetState, daemonset_state

    if not daemonset:
        return True  # no DaemonSet to consult (standalone-style run): every stop is final
    return daemonset_state(kubeconfig, namespace, daemonset) in (
        DaemonSetState.ABSENT, DaemonSetState.DELETING)
