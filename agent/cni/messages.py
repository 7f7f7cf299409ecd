"""A CNI request and answer as the agent's handler works with them: validated once, frozen,
typed.

The wire form (``{"command", "container_id", "netns", ...}``) becomes a ``CniRequest`` in
the request parser (``agent.cni.request.to_request``); the handler's own
paths that act like a CNI call (GC releasing an attachment, live enrollment capturing a
running pod) build one too. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.common.ids import ContainerId  # CNI_CONTAINERID: the sandbox's id


class CniFailure(Exception):
    """A request the handler refuses or could not carry out: the CNI error it answers."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


@dataclass(frozen=True)
class CniRequest:
    command: str  # ADD | DEL | CHECK
    container_id: ContainerId
    netns: str = ""  # the path kubelet gave (may be empty on DEL)
    ifname: str = ""
    args: Mapping[str, str] = field(default_factory=dict)  # CNI_ARGS (K8S_POD_NAME, ...)
    netconf: Mapping[str, Any] = field(default_factory=dict)  # our entry of the conflist
    ips: tuple[str, ...] = ()  # the pod's addresses from prevResult

    def but(self, **changes: Any) -> CniRequest:
        """The same request with some fields changed (a DEL aimed at another record)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class CniAnswer:
    """The handler's verdict on one request: ok, or a CNI error code with its message and
    details (the CNI spec's error object). ``to_json`` is the form ``request.render`` turns
    into the shim's ``<exit code>\n<stdout>``."""

    ok: bool
    code: int = 0
    msg: str = ""
    details: str = ""

    def to_json(self) -> dict[str, Any]:
        if self.ok:
            return {"ok": True}
        return {"ok": False, "code": self.code, "msg": self.msg, "details": self.details}
