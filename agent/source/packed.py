"""Objects held by the hundred thousand, packed: one tuple of values instead of nested dicts.

A cluster's remote pods (MeshPod records) and EndpointSlice endpoints are the store's most
numerous objects, each a handful of small dicts that differ only in their values: at 100k
pods those dicts were most of the agent's heap. ``pack`` keeps an object's shape (its keys,
and the keys of the sections named) once, shared by every object of that shape, and its
values in one flat tuple. Reading is unchanged: a ``Packed`` is a read-only ``Mapping`` whose
sections come back as fresh dicts, so ``obj.get("metadata") or {}`` works as on the JSON.
It is not a dict on purpose: ``json.dumps`` refuses it loudly instead of writing ``{}``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

Shape = tuple[tuple[str, tuple[str, ...] | None], ...]


class _Layout:
    """One shape: the top-level keys, and for each where its value (or section) starts."""

    __slots__ = ("keys", "where")

    def __init__(self, shape: Shape) -> None:
        self.keys = tuple(k for k, _ in shape)
        self.where: dict[str, tuple[int, tuple[str, ...] | None]] = {}
        i = 0
        for key, sub in shape:
            self.where[key] = (i, sub)
            i += 1 if sub is None else len(sub)


_LAYOUTS: dict[Shape, _Layout] = {}
LAYOUTS_MAX = 4096  # shapes are the few combinations of optional fields; past this, unshared


_MISSING = object()


class Packed(Mapping[str, Any]):
    """A read-only object packed by ``pack``; equal to the dict it was packed from."""

    __slots__ = ("_layout", "_values")

    def __init__(self, layout: _Layout, values: tuple[Any, ...]) -> None:
        self._layout = layout
        self._values = values

    def __getitem__(self, key: str) -> Any:
        got = self.get(key, _MISSING)
        if got is _MISSING:
            raise KeyError(key)
        return got

    def get(self, key: str, default: Any = None) -> Any:
        # the lookup itself (not through Mapping.get's __getitem__ and KeyError): the
        # registry reads ~7 keys of each of 100k remote pods
        where = self._layout.where.get(key)
        if where is None:
            return default
        i, sub = where
        if sub is None:
            return self._values[i]
        return dict(zip(sub, self._values[i:i + len(sub)], strict=True))

    def __contains__(self, key: object) -> bool:
        return key in self._layout.where

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.keys)

    def __len__(self) -> int:
        return len(self._layout.keys)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Packed) and self._layout is other._layout:
            return self._values == other._values  # the common case: one shape, no dicts
        if isinstance(other, Mapping):
            return self.unpack() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def unpack(self) -> dict[str, Any]:
        """The object as plain dicts (sections fresh; their values shared with this one)."""
        return {k: self[k] for k in self._layout.keys}

    def __repr__(self) -> str:
        return f"Packed({self.unpack()!r})"


def pack(obj: Mapping[str, Any], sections: tuple[str, ...] = ()) -> Packed:
    """``obj`` packed; each key in ``sections`` whose value is a dict is flattened into the
    values (its own values stay as they are: shared label maps remain shared)."""
    shape: list[tuple[str, tuple[str, ...] | None]] = []
    values: list[Any] = []
    for key, value in obj.items():
        if key in sections and isinstance(value, dict):
            shape.append((key, tuple(value)))
            values.extend(value.values())
        else:
            shape.append((key, None))
            values.append(value)
    frozen = tuple(shape)
    layout = _LAYOUTS.get(frozen)
    if layout is None:
        layout = _Layout(frozen)
        if len(_LAYOUTS) < LAYOUTS_MAX:
            _LAYOUTS[frozen] = layout
    return Packed(layout, tuple(values))


def unpacked(obj: Any) -> Any:
    """``obj`` as plain dicts when it is packed (for writers and JSON); else ``obj``."""
    return obj.unpack() if isinstance(obj, Packed) else obj
