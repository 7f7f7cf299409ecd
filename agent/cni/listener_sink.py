"""Where the capture lifecycle hands a captured pod to the proxy: the listener sink protocol
(Envoy's sink implements it) and the no-proxy sink. Apart from the handler so the composition
and the proxy side can name the contract without the lifecycle behind it."""

from __future__ import annotations

from typing import Protocol

from agent.cni.state import CapturedPod


class ListenerSink(Protocol):
    """Where captured pods become Envoy listeners (the Envoy issue plugs in here)."""

    def add_pod(self, pod: CapturedPod) -> None:
        """Return once the pod's listener is live; raise on failure or timeout."""
        ...

    def remove_pod(self, pod: CapturedPod) -> None:
        """Return once the listener is gone."""
        ...


class NullSink:
    """No proxy (rules only): used by tests of the capture layer and `--no-envoy`."""

    def add_pod(self, pod: CapturedPod) -> None:
        return None

    def remove_pod(self, pod: CapturedPod) -> None:
        return None
