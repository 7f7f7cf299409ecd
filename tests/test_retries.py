"""The single-call retries, on tenacity: the taint patch re-reads the Node on a 409, the
EndpointSlice cleanup on exit tries again after a failure; each gives up when told to."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.node.readiness import TAINT_KEY, NodeReadiness


class FakeCore:
    """CoreV1Api's two calls the taint needs; the first ``conflicts`` patches answer 409."""

    def __init__(self, conflicts: int) -> None:
        self.conflicts = conflicts
        self.reads = 0
        self.patches: list[dict[str, Any]] = []

    def read_node(self, name: str, **kw: Any) -> Any:
        self.reads += 1

        class Resp:
            data = (b'{"metadata": {"resourceVersion": "%d"}, "spec": {"taints": []}}'
                    % self.reads)

            def release_conn(self) -> None:
                return None
        return Resp()

    def patch_node(self, name: str, body: dict[str, Any], **kw: Any) -> Any:
        if self.conflicts > 0:
            self.conflicts -= 1
            raise ApiException(status=409, reason="Conflict")
        self.patches.append(body)

        class Resp:
            data = b"{}"

            def release_conn(self) -> None:
                return None
        return Resp()


def _readiness(core: FakeCore, attempts: int = 5) -> NodeReadiness:
    nr = NodeReadiness(client.ApiClient(), "node-a", attempts=attempts)
    nr.core = core  # type: ignore[assignment]
    return nr


def test_a_conflicting_taint_patch_reads_the_node_again() -> None:
    core = FakeCore(conflicts=2)
    assert _readiness(core).mark_not_ready() is True
    assert core.reads == 3 and len(core.patches) == 1  # read, 409, read, 409, read, patch
    (body,) = core.patches
    assert body["metadata"]["resourceVersion"] == "3"  # the patch carries the fresh read
    assert [t["key"] for t in body["spec"]["taints"]] == [TAINT_KEY]


def test_a_taint_patch_that_keeps_conflicting_gives_up() -> None:
    core = FakeCore(conflicts=10)
    with pytest.raises(RuntimeError, match="kept conflicting"):
        _readiness(core, attempts=3).mark_not_ready()
    assert core.reads == 3 and core.patches == []


def test_other_api_errors_are_not_retried() -> None:
    class Broken(FakeCore):
        def patch_node(self, name: str, body: dict[str, Any], **kw: Any) -> Any:
            raise ApiException(status=403, reason="Forbidden")
    core = Broken(conflicts=0)
    with pytest.raises(ApiException):
        _readiness(core).mark_not_ready()
    assert core.reads == 1


def test_the_slice_cleanup_on_exit_tries_again_then_gives_up() -> None:
    from agent.slices.writer import SliceProjector

    class Writer:
        def __init__(self, failures: int) -> None:
            self.failures, self.calls, self.resyncs = failures, 0, 0

        def reconcile(self, desired: dict[Any, Any]) -> None:
            self.calls += 1
            if self.failures > 0:
                self.failures -= 1
                raise OSError("API unreachable")

        def resync(self) -> None:
            self.resyncs += 1

    for failures, calls, resyncs in ((1, 2, 1), (5, 3, 2)):
        proj = SliceProjector.__new__(SliceProjector)
        proj.writer = Writer(failures)  # type: ignore[assignment]
        proj.interval = 0.01
        proj.stop_loop = lambda timeout: None  # type: ignore[method-assign]
        proj.stop(node_leaving=True, attempts=3)
        got = proj.writer
        assert (got.calls, got.resyncs) == (calls, resyncs), failures  # type: ignore[attr-defined]
