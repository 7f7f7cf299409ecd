"""A cluster DNS for tests: UDP and TCP on port 53 in a netns of its own, answering from a
table and recording every query it sees (name, type, transport, the asker's address).

Names not in the table get NXDOMAIN; a name in ``truncate`` is answered over UDP with TC set
and no records (the client must ask again over TCP, where it gets the records). Each answer
it sent is kept (``sent``) so a test can check the pod got those bytes, unchanged.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

from agent.dns import wire
from agent.netns.enter import run_in_netns


@dataclass
class Seen:
    name: str
    qtype: int
    transport: str
    peer: str


@dataclass
class ClusterDns:
    netns: str
    records: dict[str, tuple[str, ...]] = field(default_factory=dict)
    truncate: set[str] = field(default_factory=set)
    seen: list[Seen] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)

    def start(self) -> ClusterDns:
        def make() -> tuple[socket.socket, socket.socket]:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("0.0.0.0", 53))
            t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            t.bind(("0.0.0.0", 53))
            t.listen(16)
            return u, t
        self._lock = threading.Lock()
        self.udp, self.tcp = run_in_netns(self.netns, make)
        self._stop = False
        for target in (self._udp_loop, self._tcp_loop):
            threading.Thread(target=target, daemon=True).start()
        return self

    def _answer(self, data: bytes, transport: str, peer: str) -> bytes:
        q = wire.parse_query(data)
        with self._lock:
            self.seen.append(Seen(q.name, q.qtype, transport, peer))
        ips = self.records.get(q.name)
        if ips is None:
            out = wire.response(q, wire.RCODE_NXDOMAIN, authoritative=True)
        elif transport == "udp" and q.name in self.truncate:
            out = wire.response(q, wire.RCODE_NOERROR, tuple(ips) * 100)  # too big: TC
        else:
            out = wire.response(q, wire.RCODE_NOERROR, ips, ttl=30, udp=transport == "udp")
        with self._lock:
            self.sent.append(out)
        return out

    def _udp_loop(self) -> None:
        while not self._stop:
            try:
                data, peer = self.udp.recvfrom(65535)
                if peer is None:  # shut down
                    return
                self.udp.sendto(self._answer(data, "udp", peer[0]), peer)
            except (OSError, wire.MalformedQuery):
                if self._stop:
                    return

    def _tcp_loop(self) -> None:
        while not self._stop:
            try:
                conn, peer = self.tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    n = struct.unpack("!H", _read(conn, 2))[0]
                    conn.sendall(wire.tcp_frame(self._answer(_read(conn, n), "tcp", peer[0])))
                except (OSError, struct.error, wire.MalformedQuery):
                    continue

    def names_seen(self) -> list[str]:
        with self._lock:
            return [s.name for s in self.seen]

    def close(self) -> None:
        self._stop = True
        for s in (self.udp, self.tcp):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _read(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise OSError("closed")
        out += chunk
    return out


def build_query(name: str, qtype: int = wire.TYPE_A, qid: int = 0x4A11) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    return wire.HEADER.pack(qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", qtype,
                                                                       wire.CLASS_IN)


def ask(netns: str, server: str, name: str, qtype: int = wire.TYPE_A, tcp: bool = False,
        timeout: float = 3.0, mark: int | None = None) -> bytes:
    """One query from inside ``netns`` to ``server``:53, as a pod's resolver sends it; the
    raw answer (b"" on a timeout)."""
    query = build_query(name, qtype)

    def work() -> bytes:
        kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
        with socket.socket(socket.AF_INET, kind) as s:
            if mark is not None:
                s.setsockopt(socket.SOL_SOCKET, 36, mark)  # SO_MARK: what CAP_NET_RAW allows
            s.settimeout(timeout)
            try:
                s.connect((server, 53))
                if tcp:
                    s.sendall(wire.tcp_frame(query))
                    n = struct.unpack("!H", _read(s, 2))[0]
                    return _read(s, n)
                s.send(query)
                return s.recv(65535)
            except (TimeoutError, OSError):
                return b""
    return run_in_netns(netns, work)


def addresses(answer: bytes) -> tuple[int, list[str], bool]:
    """(rcode, A/AAAA addresses, truncated) of an answer to ``build_query``'s query."""
    _qid, flags, _qd, an, _ns, _ar = wire.HEADER.unpack_from(answer)
    at = wire.HEADER.size
    while answer[at]:
        at += 1 + answer[at]
    at += 5
    out = []
    for _ in range(an):
        at += 2 if answer[at] & 0xC0 == 0xC0 else 0
        rtype, _cls, _ttl, rdlen = struct.unpack_from("!HHIH", answer, at)
        rdata = answer[at + 10:at + 10 + rdlen]
        if rtype in (wire.TYPE_A, wire.TYPE_AAAA):
            out.append(socket.inet_ntop(socket.AF_INET if rtype == wire.TYPE_A
                                        else socket.AF_INET6, rdata))
        at += 10 + rdlen
    return flags & 0xF, out, bool(flags & 0x0200)
