"""DNS messages as far as the pod's DNS needs them: read one question, write an answer.

Pure bytes in, bytes out. A query the captured DNS answers itself (a mesh name) gets a
response built here; every other query is relayed byte for byte and never parsed past its
question. RFC 1035 §4 for the layout, RFC 6891 for the OPT record echoed back.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

TYPE_A, TYPE_AAAA, TYPE_OPT, TYPE_ANY = 1, 28, 41, 255
CLASS_IN = 1
RCODE_NOERROR, RCODE_FORMERR, RCODE_SERVFAIL, RCODE_NXDOMAIN, RCODE_REFUSED = 0, 1, 2, 3, 5
OPCODE_QUERY = 0
HEADER = struct.Struct("!HHHHHH")
#: Without EDNS a UDP response holds at most this (RFC 1035 §4.2.1); larger sets truncate.
UDP_PLAIN_MAX = 512
MAX_NAME = 255


class MalformedQuery(ValueError):
    """Not a query this server can read: answered FORMERR (if it has an ID) or dropped."""


@dataclass(frozen=True)
class Question:
    """The one question of a query, and what its response must echo."""

    qid: int
    flags: int
    name: str  # lower case, no trailing dot ("" is the root)
    qtype: int
    qclass: int
    raw_question: bytes  # the question section as sent (its case kept: 0x20 encoding)
    edns_size: int | None  # the OPT record's UDP payload size, None without one

    @property
    def recursion_desired(self) -> bool:
        return bool(self.flags & 0x0100)


def _read_name(data: bytes, at: int) -> tuple[str, int]:
    """A question name: plain labels only (a query's question is never compressed)."""
    labels: list[str] = []
    total = 0
    while True:
        if at >= len(data):
            raise MalformedQuery("name runs past the message")
        n = data[at]
        at += 1
        if n == 0:
            break
        if n & 0xC0:
            raise MalformedQuery("compressed name in a question")
        label = data[at:at + n]
        if len(label) != n:
            raise MalformedQuery("label runs past the message")
        total += n + 1
        if total > MAX_NAME:
            raise MalformedQuery("name longer than 255 octets")
        labels.append(label.decode("ascii", errors="replace").lower())
        at += n
    return ".".join(labels), at


def _skip_name(data: bytes, at: int) -> int:
    while True:
        if at >= len(data):
            raise MalformedQuery("name runs past the message")
        n = data[at]
        if n & 0xC0 == 0xC0:
            return at + 2
        at += 1 + n
        if n == 0:
            return at


def parse_query(data: bytes) -> Question:
    """The question of a standard query with exactly one; MalformedQuery otherwise."""
    if len(data) < HEADER.size:
        raise MalformedQuery("shorter than a DNS header")
    qid, flags, qd, an, ns, ar = HEADER.unpack_from(data)
    if flags & 0x8000:
        raise MalformedQuery("a response, not a query")
    if qd != 1:
        raise MalformedQuery(f"{qd} questions (one expected)")
    name, at = _read_name(data, HEADER.size)
    if at + 4 > len(data):
        raise MalformedQuery("question runs past the message")
    qtype, qclass = struct.unpack_from("!HH", data, at)
    raw_question = data[HEADER.size:at + 4]
    at += 4
    edns: int | None = None
    try:  # the OPT record, if any, sits in the additional section
        for _ in range(an + ns):
            at = _skip_name(data, at)
            at += 10 + struct.unpack_from("!H", data, at + 8)[0]
        for _ in range(ar):
            start = at
            at = _skip_name(data, at)
            rtype, rclass = struct.unpack_from("!HH", data, at)
            rdlen = struct.unpack_from("!H", data, at + 8)[0]
            if rtype == TYPE_OPT and data[start] == 0:
                edns = max(UDP_PLAIN_MAX, rclass)
            at += 10 + rdlen
    except struct.error:
        edns = None  # a broken additional section: answered as a plain query
    return Question(qid, flags, name, qtype, qclass, raw_question, edns)


def query_id(data: bytes) -> int | None:
    return struct.unpack_from("!H", data)[0] if len(data) >= 2 else None


def _record(qtype: int, ttl: int, rdata: bytes) -> bytes:
    # the owner is the question's name: a pointer to offset 12
    return struct.pack("!HHHIH", 0xC00C, qtype, CLASS_IN, ttl, len(rdata)) + rdata


def _opt(size: int) -> bytes:
    return b"\x00" + struct.pack("!HHIH", TYPE_OPT, size, 0, 0)


def response(q: Question, rcode: int, addresses: tuple[str, ...] = (), ttl: int = 5,
             authoritative: bool = True, udp: bool = True) -> bytes:
    """The answer to ``q``: its ID, question (as sent) and RD echoed; RA set (the pod's DNS
    recurses for it by forwarding); ``addresses`` of the question's family become A or AAAA
    records. Over UDP, a set that does not fit the client's size is truncated (TC, no
    records) and the client retries over TCP, as RFC 1035 asks."""
    records = []
    for a in addresses:
        ip = ipaddress.ip_address(a)
        if q.qtype in (TYPE_A, TYPE_ANY) and ip.version == 4:
            records.append(_record(TYPE_A, ttl, ip.packed))
        elif q.qtype in (TYPE_AAAA, TYPE_ANY) and ip.version == 6:
            records.append(_record(TYPE_AAAA, ttl, ip.packed))
    flags = 0x8000 | (q.flags & 0x7900) | 0x0080 | (rcode & 0xF)  # QR, opcode+RD kept, RA
    if authoritative:
        flags |= 0x0400
    extra = [_opt(1232)] if q.edns_size is not None else []
    body = b"".join(records)
    limit = q.edns_size or UDP_PLAIN_MAX
    if udp and HEADER.size + len(q.raw_question) + len(body) + sum(map(len, extra)) > limit:
        flags |= 0x0200
        records, body = [], b""
    head = HEADER.pack(q.qid, flags, 1, len(records), 0, len(extra))
    return head + q.raw_question + body + b"".join(extra)


def error_for(data: bytes, rcode: int) -> bytes | None:
    """An error response to a query that could not be read (FORMERR) or served (SERVFAIL):
    the ID and as much of the question as reads; None when not even an ID does."""
    try:
        q = parse_query(data)
    except MalformedQuery:
        qid = query_id(data)
        if qid is None:
            return None
        flags = struct.unpack_from("!H", data, 2)[0] if len(data) >= 4 else 0
        if flags & 0x8000:
            return None  # never answer a response (no reflection loops)
        return HEADER.pack(qid, 0x8000 | (flags & 0x7900) | 0x0080 | rcode, 0, 0, 0, 0)
    return response(q, rcode, authoritative=False)


def tcp_frame(message: bytes) -> bytes:
    """RFC 1035 §4.2.2: over TCP each message carries a two-octet length."""
    return struct.pack("!H", len(message)) + message
