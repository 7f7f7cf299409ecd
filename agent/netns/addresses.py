"""The node's own addresses, read once at agent start: STRICT pods accept plaintext only
from these (kubelet's health probes leave the node from one of them)."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time


def usable(addresses: list[str]) -> tuple[str, ...]:
    """Drop loopback and link-local (pure): a pod never sees the node by those."""
    out: list[str] = []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        if ip.is_loopback or ip.is_link_local or str(ip) in out:
            continue
        out.append(str(ip))
    return tuple(sorted(out))


def node_addresses() -> tuple[str, ...]:
    """Every address of the netns the agent runs in (the node's, as a hostNetwork pod):
    one RTM_GETADDR dump over a netlink socket (a STRICT ADD asks for it, so it costs a
    few syscalls, not a netlink library's set-up)."""
    return usable(list(_dump_addresses()))


_RTM_NEWADDR, _RTM_GETADDR, _NLMSG_DONE, _NLMSG_ERROR = 20, 22, 3, 2
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2


def _dump_addresses() -> list[str]:
    """Each address's IFA_LOCAL (its own address; IFA_ADDRESS is the peer's on a
    point-to-point link), else its IFA_ADDRESS."""
    import socket
    import struct

    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       socket.NETLINK_ROUTE) as sk:
        sk.bind((0, 0))
        req = struct.pack("=IHHII", 16 + 8, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        sk.send(req + struct.pack("=BBBBI", socket.AF_UNSPEC, 0, 0, 0, 0))
        out: list[str] = []
        while True:
            data = sk.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    return out
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, off + 16)
                    if err:
                        raise OSError(-err, "RTM_GETADDR dump failed")
                elif kind == _RTM_NEWADDR:
                    family = data[off + 16]
                    size = 4 if family == socket.AF_INET else 16
                    attrs: dict[int, bytes] = {}
                    a = off + 16 + 8
                    while a + 4 <= off + length:
                        alen, atype = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        attrs[atype] = data[a + 4:a + alen]
                        a += (alen + 3) & ~3
                    raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
                    if raw is not None and len(raw) == size:
                        out.append(socket.inet_ntop(family, raw))
                off += (length + 3) & ~3


class _Cache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at = -1e9
        self.value: tuple[str, ...] = ()


_cache = _Cache()
log = logging.getLogger("aether.agent")


def current(max_age: float = 1.0) -> tuple[str, ...]:
    """``node_addresses()`` at most ``max_age`` seconds old. Read when a STRICT policy is
    decided, not once at start: a bridge CNI gives the node its gateway address only with
    the first pod, and node addresses change (DHCP, new interfaces)."""
    with _cache.lock:
        now = time.monotonic()
        if now - _cache.at > max_age:
            try:
                _cache.value = node_addresses()
            except Exception as e:  # noqa: BLE001 - reported; STRICT then refuses probes too
                log.error(
                    "cannot read the node's addresses (%s): STRICT pods refuse kubelet probes", e)
            _cache.at = now
        return _cache.value
