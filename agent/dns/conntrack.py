"""The destination a pod's UDP query was sent to before the capture rule redirected it.

TCP has SO_ORIGINAL_DST; the kernel offers nothing like it for UDP. The redirect's
conntrack entry holds it, so the pod's DNS asks conntrack (ctnetlink, in the pod's netns)
for the entry whose *reply* tuple is the datagram as the DNS socket received it, and reads
the original tuple's destination. Encoding and decoding are pure; one netlink socket per
pod netns does the asking.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET = 0, 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NLA_F_NESTED = 0x8000
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY = 1, 2
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
_NLMSG = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")

Address = tuple[str, int]


class NoEntry(LookupError):
    """conntrack has no such flow (it expired, or the datagram was not redirected)."""


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\x00" * (-len(payload) % 4)


def _nested(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(attrs))


def encode_get(local: Address, peer: Address, seq: int) -> bytes:
    """A CT GET for the UDP flow whose reply goes ``local`` → ``peer``."""
    v6 = ":" in local[0]
    family = socket.AF_INET6 if v6 else socket.AF_INET
    ip = _nested(CTA_TUPLE_IP,
                 _attr(CTA_IP_V6_SRC if v6 else CTA_IP_V4_SRC, socket.inet_pton(family, local[0])),
                 _attr(CTA_IP_V6_DST if v6 else CTA_IP_V4_DST, socket.inet_pton(family, peer[0])))
    proto = _nested(CTA_TUPLE_PROTO,
                    _attr(CTA_PROTO_NUM, bytes([socket.IPPROTO_UDP])),
                    _attr(CTA_PROTO_SRC_PORT, struct.pack("!H", local[1])),
                    _attr(CTA_PROTO_DST_PORT, struct.pack("!H", peer[1])))
    body = _NFGEN.pack(family, 0, 0) + _nested(CTA_TUPLE_REPLY, ip, proto)
    kind = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET
    return _NLMSG.pack(_NLMSG.size + len(body), kind, NLM_F_REQUEST, seq, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    at = 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            break
        out[kind & ~NLA_F_NESTED & 0x7FFF] = data[at + 4:at + length]
        at += (length + 3) & ~3
    return out


def decode_original_dst(reply: bytes, seq: int) -> Address | None:
    """The original destination in a CT GET's answer; NoEntry or OSError for the kernel's
    error; None when ``reply`` holds nothing for ``seq`` (a late answer to an earlier GET)."""
    at = 0
    while at + _NLMSG.size <= len(reply):
        length, kind, _flags, got_seq, _pid = _NLMSG.unpack_from(reply, at)
        if length < _NLMSG.size:
            break
        msg = reply[at + _NLMSG.size:at + length]
        at += (length + 3) & ~3
        if got_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", msg)[0]
            if code == 0:
                continue  # an ACK
            if code == errno.ENOENT:
                raise NoEntry("no conntrack entry for the datagram")
            raise OSError(code, os.strerror(code))
        if kind != (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW:
            continue
        orig = _attrs(_attrs(msg[_NFGEN.size:]).get(CTA_TUPLE_ORIG, b""))
        ip, proto = _attrs(orig.get(CTA_TUPLE_IP, b"")), _attrs(orig.get(CTA_TUPLE_PROTO, b""))
        raw = ip.get(CTA_IP_V4_DST) or ip.get(CTA_IP_V6_DST)
        port = proto.get(CTA_PROTO_DST_PORT)
        if raw is None or port is None:
            raise NoEntry("the conntrack entry has no original destination")
        family = socket.AF_INET6 if len(raw) == 16 else socket.AF_INET
        return socket.inet_ntop(family, raw), struct.unpack("!H", port[:2])[0]
    return None


class Conntrack:
    """One ctnetlink socket, opened in the pod's netns (its conntrack table is the one
    asked). A lookup is one request and its answer; serialised, as the socket is shared."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                   NETLINK_NETFILTER)
        self._sock.bind((0, 0))
        self._sock.settimeout(1.0)
        self._lock = threading.Lock()
        self._seq = 0

    def original_dst(self, local: Address, peer: Address) -> Address:
        with self._lock:
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            seq = self._seq
            self._sock.send(encode_get(local, peer, seq))
            while True:  # until the answer to this GET (a socket timeout ends it)
                got = decode_original_dst(self._sock.recv(65536), seq)
                if got is not None:
                    return got

    def close(self) -> None:
        self._sock.close()
