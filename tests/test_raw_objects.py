"""The TypedDicts of agent/source/objects.py say which fields the agent reads; the slim
transforms keep exactly what those name. A field the transforms keep but no TypedDict
declares (or the reverse drift) fails here."""

from __future__ import annotations

import typing
from typing import Any

from agent.source.model import slim_endpoint_slice, slim_pod
from agent.source.objects import EndpointSliceObject, PodObject
from tests.test_slim_pod import realistic_pod
from tests.test_slim_slice import realistic_slice


def _is_typeddict(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, dict) and hasattr(t, "__total__")


def undeclared(obj: Any, td: Any, path: str = "") -> list[str]:
    """Paths of keys in ``obj`` that ``td`` (a TypedDict, nested ones followed) does not
    declare."""
    if not isinstance(obj, dict):
        return []
    hints = typing.get_type_hints(td)
    out = []
    for key, value in obj.items():
        where = f"{path}.{key}" if path else key
        if key not in hints:
            out.append(where)
            continue
        t = hints[key]
        if _is_typeddict(t):
            out += undeclared(value, t, where)
        elif typing.get_origin(t) is list and _is_typeddict(typing.get_args(t)[0]):
            for i, item in enumerate(value if isinstance(value, list) else []):
                out += undeclared(item, typing.get_args(t)[0], f"{where}[{i}]")
    return out


def test_a_slim_pod_holds_only_declared_fields() -> None:
    assert undeclared(slim_pod(realistic_pod()), PodObject) == []


def test_a_slim_endpoint_slice_holds_only_declared_fields() -> None:
    assert undeclared(slim_endpoint_slice(realistic_slice()), EndpointSliceObject) == []


def test_the_check_sees_what_a_full_object_carries_beyond_them() -> None:
    extra = undeclared(realistic_pod(), PodObject)
    assert "metadata.managedFields" in extra and "spec.volumes" in extra
    assert "spec.containers[0].env" in extra and "status.containerStatuses" in extra
