"""Resources held serialized (``RawResource``) and the content hash the xDS server
versions them by."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from envoy.config.listener.v3 import listener_components_pb2
from google.protobuf.message import Message

# Listener.filter_chains is field 3, length-delimited: tag byte 3 << 3 | 2.
_FILTER_CHAINS_TAG = bytes([3 << 3 | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_chains(chains: Sequence[listener_components_pb2.FilterChain]) -> bytes:
    """``chains`` as the wire bytes of ``Listener.filter_chains`` entries (deterministic).

    Protobuf wire format lets repeated fields be appended in any position, so a namespace
    listener is its small head serialized + the concatenated chain bytes of every Service:
    the 10k-chain listener is assembled with one ``bytes.join`` and never exists as a proto.
    """
    out = []
    for c in chains:
        data = c.SerializeToString(deterministic=True)
        out += [_FILTER_CHAINS_TAG, _varint(len(data)), data]
    return b"".join(out)


class RawResource:
    """A resource held as its serialized bytes (the big namespace listeners).

    Quacks enough like the proto for the xDS server (``SerializeToString``, ``ByteSize``,
    ``name``); ``message()`` parses a fresh proto (and attribute access falls back to it,
    for tests and debugging: each access parses, so do not use it on hot paths).
    """

    __slots__ = ("name", "data", "cls", "_digest")

    def __init__(self, cls: type[Message], name: str, data: bytes) -> None:
        self.cls = cls
        self.name = name
        self.data = data
        self._digest: str | None = None

    def digest(self) -> str:
        """``resource_hash``, computed once: the bytes never change (the xDS server needs no
        memo of it, which at 10k Services was ~3 MB)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.data).hexdigest()[:16]
        return self._digest

    def SerializeToString(self, deterministic: bool = False) -> bytes:  # noqa: N802 - proto API
        return self.data

    def ByteSize(self) -> int:  # noqa: N802 - proto API
        return len(self.data)

    def message(self) -> Any:
        msg = self.cls()
        msg.ParseFromString(self.data)
        return msg

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.message(), attr)

    def __repr__(self) -> str:
        return f"RawResource({self.cls.__name__}, {self.name!r}, {len(self.data)} bytes)"


def resource_hash(msg: Message | RawResource) -> str:
    """Stable content hash used as the per-resource version in delta xDS."""
    if type(msg) is RawResource:
        return msg.digest()
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).hexdigest()[:16]
