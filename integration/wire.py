"""What crosses a pod's interface, read with a raw packet socket opened in the pod's netns:
the TCP payloads between two addresses, to tell TLS from plaintext on the mesh hop."""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

from agent.netns.enter import run_in_netns

ETH_P_ALL = 0x0003


@dataclass
class Segment:
    src: str
    sport: int
    dst: str
    dport: int
    flags: int
    payload: bytes


@dataclass
class Sniffer:
    """Every IPv4 TCP segment seen on ``ifname`` of the netns while running."""

    netns: str
    ifname: str = "eth0"
    segments: list[Segment] = field(default_factory=list)

    def __enter__(self) -> Sniffer:
        def open_sock() -> socket.socket:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.bind((self.ifname, 0))
            s.settimeout(0.2)
            return s

        self._sock = run_in_netns(self.netns, open_sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            seg = parse(frame)
            if seg is not None:
                self.segments.append(seg)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()

    def between(self, a: str, b: str) -> list[Segment]:
        return [s for s in self.segments if {s.src, s.dst} == {a, b}]


def parse(frame: bytes) -> Segment | None:
    if len(frame) < 14 + 20 or struct.unpack("!H", frame[12:14])[0] != 0x0800:
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    if ip[9] != 6 or len(ip) < ihl + 20:
        return None
    tcp = ip[ihl:total]
    sport, dport = struct.unpack("!HH", tcp[:4])
    off = (tcp[12] >> 4) * 4
    return Segment(socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport,
                   tcp[13], bytes(tcp[off:]))
