"""The running agent's parts that its helpers (status document, probes) read, as one
protocol: they see the ``Agent`` through it, so none imports the composition
(``agent.runtime.app``) that imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from agent.cni.handler import CniHandler, ListenerSink
from agent.cni.state import StateStore
from agent.runtime.options import AgentOptions

if TYPE_CHECKING:
    from agent.node.repair import RepairLoop


class AgentParts(Protocol):
    """What every reader of the agent reads (``agent.runtime.app.Agent``)."""

    @property
    def options(self) -> AgentOptions: ...
    @property
    def sink(self) -> ListenerSink: ...
    @property
    def handler(self) -> CniHandler: ...
    @property
    def store(self) -> StateStore: ...
    @property
    def repair(self) -> RepairLoop | None: ...
