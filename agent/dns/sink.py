"""The pod's DNS in the capture lifecycle: a listener sink around the proxy's.

A captured pod whose policy captures DNS gets its DNS sockets bound before its listener
(the ADD fails, and the pod does not start, if they cannot be); a removed pod loses them
after. A pod restored at the agent's start is served in the background: during a take-over
the previous agent still holds the pod's DNS port until it exits, so the bind is retried
until it goes (the pod's queries are answered by the previous agent meanwhile).
Everything else is the wrapped sink's, attributes included.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from agent.capture.policy import CapturePolicy
from agent.cni.listener_sink import ListenerSink
from agent.cni.state import CapturedPod
from agent.dns.process import DnsProcess, DnsUnavailable

log = logging.getLogger("aether.dns")

RESTORE_RETRY_S = 0.2
RESTORE_GIVE_UP_S = 120.0


class DnsSink:
    def __init__(self, inner: ListenerSink, dns: DnsProcess) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "dns", dns)
        object.__setattr__(self, "_pending", {})
        object.__setattr__(self, "_previous", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)  # the app wires the proxy's callbacks through us

    def add_pod(self, pod: CapturedPod, confirm: bool = True) -> None:
        if pod.policy.dns_capture:
            try:
                self.dns.serve(pod.container_id, pod.key, pod.netns)
            except (OSError, DnsUnavailable) as e:
                raise DnsUnavailable(f"the pod's DNS is not served: {e}") from e
        try:
            if confirm:
                self.inner.add_pod(pod)
            else:
                self.inner.add_pod(pod, confirm=False)
        except BaseException:
            self.dns.unserve(pod.container_id)
            raise

    def policy_changing(self, pod: CapturedPod, policy: CapturePolicy) -> None:
        """Before a live pod's rules change: its DNS served if they will capture it."""
        if policy.dns_capture and not self.dns.serving(pod.container_id):
            self.dns.serve(pod.container_id, pod.key, pod.netns)

    def policy_changed(self, pod: CapturedPod, policy: CapturePolicy) -> None:
        """After: its DNS gone if the rules in place no longer capture it."""
        if not policy.dns_capture and self.dns.serving(pod.container_id):
            self.dns.unserve(pod.container_id)

    def restore_pod(self, pod: CapturedPod) -> None:
        restore = getattr(self.inner, "restore_pod", self.inner.add_pod)
        restore(pod)
        if pod.policy.dns_capture and not self.dns.serving(pod.container_id):
            try:
                self.dns.serve(pod.container_id, pod.key, pod.netns)
            except (OSError, DnsUnavailable) as e:
                log.info("%s: its DNS port is still held (%s); retrying in the background",
                         pod.key, e)
                self._retry(pod)

    def _retry(self, pod: CapturedPod) -> None:
        pending: dict[str, CapturedPod] = self._pending
        pending[pod.container_id] = pod

        def again() -> None:
            deadline = time.monotonic() + RESTORE_GIVE_UP_S
            while time.monotonic() < deadline and pending.get(pod.container_id) is pod:
                time.sleep(RESTORE_RETRY_S)
                try:
                    self.dns.serve(pod.container_id, pod.key, pod.netns)
                except (OSError, DnsUnavailable):
                    continue
                log.info("%s: DNS served", pod.key)
                pending.pop(pod.container_id, None)
                return
            if pending.pop(pod.container_id, None) is pod:
                log.error("%s: its DNS could not be served in %.0f s; its queries are "
                          "refused until it is re-created", pod.key, RESTORE_GIVE_UP_S)

        threading.Thread(target=again, name=f"aether-dns-restore-{pod.container_id[:12]}",
                         daemon=True).start()

    def restored(self) -> None:
        """Every recorded pod restored (this agent's DNS serves them): the previous agent's
        lingering DNS process may go."""
        self.dns.retire_previous(self._previous)

    def start(self) -> None:
        """The proxy's start, and the DNS process's (so the first ADD does not wait for a
        Python to boot)."""
        start = getattr(self.inner, "start", None)
        if callable(start):
            start()
        object.__setattr__(self, "_previous", self.dns.previous())  # before ours rewrites it
        try:
            self.dns.start()
        except OSError as e:  # the first serve tries again, and fails the ADD if it must
            log.error("the pod DNS process does not start: %s", e)

    def remove_pod(self, pod: CapturedPod) -> None:
        self._pending.pop(pod.container_id, None)
        try:
            self.inner.remove_pod(pod)
        finally:
            self.dns.unserve(pod.container_id)

    def stop(self, **kwargs: Any) -> None:
        """The proxy's stop (``keep_envoy`` and all), then the DNS process's: the pods' DNS
        goes with this agent (a next agent binds it again, see ``restore_pod``)."""
        # first: its process is in the proxy's cgroup, which Envoy's stop removes; kept
        # (lingering) with Envoy across a restart
        self.dns.stop(linger=bool(kwargs.get("keep_envoy")))
        stop = getattr(self.inner, "stop", None)
        if callable(stop):
            stop(**kwargs)
