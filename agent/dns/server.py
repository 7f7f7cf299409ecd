"""The pod's DNS: the process that answers captured DNS in every pod netns of the node.

It runs apart from the agent, in the proxy's cgroup (started by ``agent.dns.process``), for
two reasons: its upstream sockets must be the proxy's to pass the pods' capture rules (the
mark and the cgroup, agent/netns/cgroup.py), and its sockets (a few per pod) must not crowd
the agent's descriptors, where libnftables' select() aborts past 1024.

Per pod it holds a UDP and a TCP socket on the loopback of the pod's netns (127.0.0.1 and
::1, port ``dns_port``), where the capture rule redirects the pod's port-53 traffic. A mesh
name is answered here (``agent.dns.names``, the Service looked up in the agent); every
other query goes unchanged to the server the pod asked, from the pod's netns, and its answer
comes back unchanged. Bounded: at most ``max_inflight`` forwarded queries per pod, each
``timeout`` at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import struct
import sys
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from agent.dns import wire
from agent.dns.conntrack import Conntrack, NoEntry
from agent.dns.names import FORWARD, Verdict, decide, wanted
from agent.netns.enter import _setns

log = logging.getLogger("aether.dns")

SO_MARK = 36
SO_ORIGINAL_DST = 80
_CONTROL_MAX = 65536
TCP_IDLE_S = 10.0
DRAIN_S = 2.0
#: the agent may hold a lookup up to 2 s (a first call's Service readied: HOLD_S)
LOOKUP_TIMEOUT_S = 3.0
#: the agent's answers are kept this long: the TTL of the answers built from them
CACHE_S = 5.0
CACHE_MAX = 8192
#: upstream sockets made per visit to a pod's netns (two setns calls each visit)
SOCKET_BATCH = 16


@dataclass
class PodDns:
    """One pod's DNS sockets and counters."""

    container_id: str
    key: str
    netns_fd: int
    udp: list[socket.socket] = field(default_factory=list)
    tcp: list[socket.socket] = field(default_factory=list)
    servers: list[asyncio.base_events.Server] = field(default_factory=list)
    conntrack: Conntrack | None = None
    inflight: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    spare: dict[int, list[socket.socket]] = field(default_factory=dict)  # family → sockets

    def close(self) -> None:
        for sockets in self.spare.values():
            for s in sockets:
                s.close()
        for srv in self.servers:
            srv.close()
        for s in self.udp + self.tcp:
            s.close()
        if self.conntrack is not None:
            self.conntrack.close()
        os.close(self.netns_fd)


class DnsServer:
    """The event loop side. ``lookup`` asks the agent for a name's addresses."""

    def __init__(self, mesh_domain: str, port: int, mark: int, timeout: float,
                 max_inflight: int, lookup: Callable[[str, str, str], Any]) -> None:
        self.mesh_domain = mesh_domain
        self.port = port
        self.mark = mark
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.lookup = lookup  # async (kind, namespace, name) -> tuple | None
        self._cached: Callable[[tuple[str, str, str]], tuple[Any] | None] | None = None
        self.pods: dict[str, PodDns] = {}
        self.active = 0  # UDP queries being answered (``drain`` waits for them)
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    # ---- sockets in the pod's netns -------------------------------------------------
    def _in_netns(self, fd: int, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` with this (single) thread in the pod's netns, then come home."""
        _setns(fd)
        try:
            return fn()
        finally:
            _setns(self._home)

    def _listen(self) -> tuple[list[socket.socket], list[socket.socket], Conntrack]:
        udp: list[socket.socket] = []
        tcp: list[socket.socket] = []
        try:
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                try:
                    u = socket.socket(family, socket.SOCK_DGRAM)
                    if family == socket.AF_INET6:
                        u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    # beside the previous agent's DNS process until it exits (a restart or
                    # an upgrade hands over without a refused query; docs/operations.md)
                    u.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    u.bind((host, self.port))
                except OSError as e:
                    u.close()
                    if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL,
                                                                 errno.EAFNOSUPPORT):
                        continue  # no IPv6 loopback in this pod: nothing is redirected there
                    raise
                udp.append(u)
                t = socket.socket(family, socket.SOCK_STREAM)
                tcp.append(t)
                if family == socket.AF_INET6:
                    t.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                t.bind((host, self.port))
                t.listen(128)
            return udp, tcp, Conntrack()
        except BaseException:
            for s in udp + tcp:
                s.close()
            raise

    def _upstream(self, pod: PodDns, family: int, kind: int) -> socket.socket:
        """A marked socket of the pod's netns, unbound (each query gets its own source
        port when it connects). UDP ones are made ``SOCKET_BATCH`` at a time."""
        def make(n: int) -> list[socket.socket]:
            out = []
            for _ in range(n):
                s = socket.socket(family, kind)
                out.append(s)
                s.setsockopt(socket.SOL_SOCKET, SO_MARK, self.mark)
                s.setblocking(False)
            return out
        if kind != socket.SOCK_DGRAM:
            made: list[socket.socket] = self._in_netns(pod.netns_fd, lambda: make(1))
            return made[0]
        spare = pod.spare.setdefault(family, [])
        if not spare:
            spare.extend(self._in_netns(pod.netns_fd, lambda: make(SOCKET_BATCH)))
        return spare.pop()

    async def serve(self, container_id: str, key: str, netns_fd: int) -> None:
        old = self.pods.pop(container_id, None)
        if old is not None:
            self._drop(old)
        pod = PodDns(container_id, key, netns_fd)
        try:
            pod.udp, pod.tcp, pod.conntrack = self._in_netns(netns_fd, self._listen)
        except BaseException:
            pod.close()
            raise
        loop = asyncio.get_running_loop()
        for u in pod.udp:
            u.setblocking(False)
            loop.add_reader(u.fileno(), self._on_udp, pod, u)
        for t in pod.tcp:
            t.setblocking(False)
            pod.servers.append(await asyncio.start_server(self._tcp_handler(pod), sock=t))
        self.pods[container_id] = pod

    def _tcp_handler(self, pod: PodDns) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                     Coroutine[Any, Any, None]]:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await self._on_tcp(pod, r, w)
        return handle

    def _drop(self, pod: PodDns) -> None:
        loop = asyncio.get_running_loop()
        for u in pod.udp:
            loop.remove_reader(u.fileno())
        pod.close()

    def stop(self, container_id: str) -> bool:
        pod = self.pods.pop(container_id, None)
        if pod is None:
            return False
        self._drop(pod)
        return True

    # ---- answering -----------------------------------------------------------------
    async def _verdict(self, q: wire.Question) -> Verdict:
        """The TCP path's verdict: the agent asked first when the name needs it."""
        want = wanted(q.name, self.mesh_domain)
        if want is not None and want[0] == "hold":
            try:  # readies the Service for the call that follows; the query is forwarded
                await self.lookup(*want)
            except (OSError, TimeoutError):
                pass
            return FORWARD
        return self._decided(q, want, await self.lookup(*want) if want is not None else None)

    def _decided(self, q: wire.Question, want: tuple[str, str, str] | None,
                 found: Any) -> Verdict:
        """What to do with ``q`` once the lookup ``want`` (``wanted``'s) gave ``found``: a
        standard name (``hold``) is forwarded, everything else as ``decide`` says."""
        if want is not None and want[0] == "hold":
            return FORWARD
        return decide(q.name, q.qtype, q.qclass, self.mesh_domain,
                      lambda _ns, _n: found, lambda _ns, _n: found)

    def _on_udp(self, pod: PodDns, sock: socket.socket) -> None:
        """Queries are answered from here, without a task, when no lookup is needed or
        its answer is cached (most of them); a task only waits for the agent."""
        for _ in range(64):  # a burst, then let the loop breathe
            try:
                data, peer = sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pod.counts["errors"] += 1
                return
            try:
                q: wire.Question | None = wire.parse_query(data)
            except wire.MalformedQuery:
                q = None
            if q is None:
                self._forward_udp(pod, sock, data, peer)
                continue
            want = wanted(q.name, self.mesh_domain)
            cached = self.cached(want) if want is not None else (None,)
            if cached is None:  # ask the agent first
                assert want is not None
                asyncio.ensure_future(self._udp_query(pod, sock, data, peer, q, want))
                continue
            self._udp_decided(pod, sock, data, peer, q, want, cached[0])

    def _udp_decided(self, pod: PodDns, sock: socket.socket, data: bytes, peer: Any,
                     q: wire.Question, want: tuple[str, str, str] | None, found: Any) -> None:
        verdict = self._decided(q, want, found)
        if verdict.forward:
            self._forward_udp(pod, sock, data, peer)
            return
        pod.counts[verdict.kind] += 1
        _send(sock, wire.response(q, verdict.rcode, verdict.addresses), peer)

    async def _udp_query(self, pod: PodDns, sock: socket.socket, data: bytes,
                         peer: tuple[Any, ...], q: wire.Question,
                         want: tuple[str, str, str]) -> None:
        self.active += 1
        try:
            try:
                found = await self.lookup(*want)
            except (OSError, TimeoutError):  # the agent did not answer
                if want[0] == "hold":  # a standard name: forwarded all the same
                    self._forward_udp(pod, sock, data, peer)
                    return
                pod.counts["servfail"] += 1  # a mesh name: the pod's resolver retries
                _send(sock, wire.response(q, wire.RCODE_SERVFAIL, authoritative=False), peer)
                return
            self._udp_decided(pod, sock, data, peer, q, want, found)
        finally:
            self.active -= 1

    def _forward_udp(self, pod: PodDns, sock: socket.socket, data: bytes, peer: Any) -> None:
        """Unchanged, even what this server cannot read (the pod's business with its
        resolver), to the destination the pod sent it to, from the pod's netns; the first
        datagram back with the query's ID goes to the pod unchanged. Callbacks, no task."""
        assert pod.conntrack is not None
        try:
            local = sock.getsockname()
            dst = pod.conntrack.original_dst((local[0], local[1]), (peer[0], peer[1]))
        except (NoEntry, OSError) as e:
            pod.counts["no_original_dst"] += 1
            log.debug("%s: no original destination for a query from %s: %s", pod.key, peer, e)
            return
        if dst[1] == self.port and dst[0] in ("127.0.0.1", "::1"):
            return  # asked this server directly: nothing to forward to
        if pod.inflight >= self.max_inflight:
            pod.counts["over_limit"] += 1
            reply = wire.error_for(data, wire.RCODE_SERVFAIL)
            if reply is not None:
                _send(sock, reply, peer)
            return
        try:
            up = self._upstream(pod, socket.AF_INET6 if ":" in dst[0] else socket.AF_INET,
                                socket.SOCK_DGRAM)
        except OSError as e:
            pod.counts["upstream_errors"] += 1
            log.debug("%s: no upstream socket: %s", pod.key, e)
            return
        try:
            up.connect(dst)  # UDP: no round trip; picks the source port
            up.send(data)
        except OSError as e:
            up.close()
            pod.counts["upstream_errors"] += 1
            log.debug("%s: forwarding to %s: %s", pod.key, dst, e)
            return
        loop = asyncio.get_running_loop()
        want = wire.query_id(data)
        pod.inflight += 1
        self.active += 1
        fd = up.fileno()

        def finish(kind: str) -> None:
            loop.remove_reader(fd)
            timer.cancel()
            up.close()
            pod.inflight -= 1
            self.active -= 1
            pod.counts[kind] += 1

        def on_reply() -> None:
            try:
                answer = up.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. ICMP port unreachable: the pod's resolver retries
                log.debug("%s: forwarding to %s: %s", pod.key, dst, e)
                finish("upstream_errors")
                return
            if wire.query_id(answer) != want:
                return
            _send(sock, answer, peer)
            finish("forwarded")

        timer = loop.call_later(self.timeout, finish, "upstream_timeouts")
        loop.add_reader(fd, on_reply)

    def cached(self, want: tuple[str, str, str]) -> tuple[Any] | None:
        """The agent's cached answer for ``want`` as a 1-tuple, or None (ask it)."""
        return self._cached(want) if self._cached is not None else None

    async def _on_tcp(self, pod: PodDns, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            sock = writer.get_extra_info("socket")
            dst = _original_dst(sock)
            while True:
                try:
                    async with asyncio.timeout(TCP_IDLE_S):
                        size = struct.unpack("!H", await reader.readexactly(2))[0]
                        data = await reader.readexactly(size)
                except (TimeoutError, asyncio.IncompleteReadError):
                    return
                try:
                    q: wire.Question | None = wire.parse_query(data)
                except wire.MalformedQuery:
                    q = None
                if q is not None:
                    try:
                        verdict = await self._verdict(q)
                    except (OSError, TimeoutError):  # the agent did not answer: SERVFAIL
                        pod.counts["servfail"] += 1
                        writer.write(wire.tcp_frame(wire.response(
                            q, wire.RCODE_SERVFAIL, authoritative=False, udp=False)))
                        await writer.drain()
                        continue
                    if not verdict.forward:
                        pod.counts[verdict.kind] += 1
                        writer.write(wire.tcp_frame(
                            wire.response(q, verdict.rcode, verdict.addresses, udp=False)))
                        await writer.drain()
                        continue
                if dst is None or (dst[1] == self.port and dst[0] in ("127.0.0.1", "::1")):
                    pod.counts["no_original_dst"] += 1
                    return
                if pod.inflight >= self.max_inflight:
                    pod.counts["over_limit"] += 1
                    return
                pod.inflight += 1
                try:
                    async with asyncio.timeout(self.timeout):
                        if up is None:
                            up = await self._tcp_upstream(pod, dst)
                        up[1].write(wire.tcp_frame(data))
                        await up[1].drain()
                        n = struct.unpack("!H", await up[0].readexactly(2))[0]
                        answer = await up[0].readexactly(n)
                except TimeoutError:
                    pod.counts["upstream_timeouts"] += 1
                    return
                except (OSError, asyncio.IncompleteReadError) as e:
                    pod.counts["upstream_errors"] += 1
                    log.debug("%s: forwarding over TCP to %s: %s", pod.key, dst, e)
                    return
                finally:
                    pod.inflight -= 1
                pod.counts["forwarded"] += 1
                writer.write(wire.tcp_frame(answer))
                await writer.drain()
        except Exception:  # noqa: BLE001 - one connection's trouble is its own
            pod.counts["errors"] += 1
            log.exception("%s: DNS over TCP", pod.key)
        finally:
            if up is not None:
                up[1].close()
            writer.close()

    async def _tcp_upstream(self, pod: PodDns, dst: tuple[str, int]
                            ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        family = socket.AF_INET6 if ":" in dst[0] else socket.AF_INET
        s = self._upstream(pod, family, socket.SOCK_STREAM)
        try:
            await asyncio.get_running_loop().sock_connect(s, dst)
        except BaseException:
            s.close()
            raise
        return await asyncio.open_connection(sock=s)

    async def drain(self, within: float) -> None:
        """Stop without dropping a query: the listeners stop accepting; the UDP sockets keep
        answering until no query is in flight (or ``within`` seconds), then close, and the
        kernel sends the next queries to the next process's sockets (SO_REUSEPORT). Only a
        datagram arriving in the instant between the last answer and the close is lost."""
        loop = asyncio.get_running_loop()
        for pod in self.pods.values():
            for srv in pod.servers:
                srv.close()
        deadline = loop.time() + within
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.005)
        for pod in self.pods.values():
            for u in pod.udp:
                loop.remove_reader(u.fileno())
                u.close()

    def stats(self) -> dict[str, Any]:
        return {"pods": {p.key: dict(p.counts) | {"inflight": p.inflight}
                         for p in self.pods.values()}}


def _send(sock: socket.socket, data: bytes, peer: Any) -> None:
    with contextlib.suppress(OSError):  # a full buffer or a gone client: a lost datagram
        sock.sendto(data, peer)


def _original_dst(sock: socket.socket) -> tuple[str, int] | None:
    """SO_ORIGINAL_DST of a redirected TCP connection (IPv4 or IPv6)."""
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack_from("!H", raw, 2)[0]
            return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        port = struct.unpack_from("!H", raw, 2)[0]
        return socket.inet_ntoa(raw[4:8]), port
    except OSError:
        return None


# ---- the process: a control channel to the agent -----------------------------------
class Control:
    """The channel to the agent (SOCK_SEQPACKET, one JSON message each; a serve carries the
    pod's netns fd). The agent asks: serve, stop, stats; this side asks: lookup."""

    def __init__(self, chan: socket.socket, server_args: dict[str, Any]) -> None:
        self.chan = chan
        self.chan.setblocking(False)
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.cache: dict[tuple[str, str, str], tuple[float, Any]] = {}
        self.seq = 0
        self.server = DnsServer(lookup=self.lookup, **server_args)
        self.server._cached = self.cached
        self.done = asyncio.Event()
        # told by an agent that stops for a restart: outlive it, serving its pods (mesh
        # names get SERVFAIL, forwarding goes on) until the next agent's DNS serves them
        # and stops this one
        self.linger = False
        self.orphaned = False

    def cached(self, want: tuple[str, str, str]) -> tuple[Any] | None:
        hit = self.cache.get(want)
        if hit is not None and hit[0] > asyncio.get_running_loop().time():
            return (hit[1],)
        return None

    async def lookup(self, kind: str, ns: str, name: str) -> Any:
        """The agent's answer, kept ``CACHE_S`` (the TTL the answers carry): a name asked
        again meanwhile costs no round trip (nor a second hold of its first call)."""
        loop = asyncio.get_running_loop()
        key = (kind, ns, name)
        hit = self.cache.get(key)
        if hit is not None and hit[0] > loop.time():
            return hit[1]
        if self.orphaned:
            raise OSError("no agent to ask")
        self.seq += 1
        seq = self.seq
        fut: asyncio.Future[Any] = loop.create_future()
        self.waiting[seq] = fut
        self._send({"op": "lookup", "seq": seq, "kind": kind, "ns": ns, "name": name})
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                got = await fut
        finally:
            self.waiting.pop(seq, None)
        found = None if got is None else tuple(got)
        if len(self.cache) >= CACHE_MAX:
            self.cache.clear()
        self.cache[key] = (loop.time() + CACHE_S, found)
        return found

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self.chan.send(json.dumps(msg).encode())
        except BlockingIOError:
            self.chan.setblocking(True)
            try:
                self.chan.send(json.dumps(msg).encode())
            finally:
                self.chan.setblocking(False)

    def on_readable(self) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.chan, _CONTROL_MAX, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.done.set()
                return
            if not msg:
                if self.linger and self.server.pods:
                    self.orphaned = True
                    asyncio.get_running_loop().remove_reader(self.chan.fileno())
                    log.info("the agent is gone; serving its %d pods until the next "
                             "agent's DNS takes over", len(self.server.pods))
                else:
                    self.done.set()  # the agent is gone: so is its pods' DNS
                return
            asyncio.ensure_future(self._handle(json.loads(msg), fds))

    async def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        op = msg.get("op")
        if op == "answer":
            fut = self.waiting.get(int(msg["seq"]))
            if fut is not None and not fut.done():
                fut.set_result(msg.get("ips"))
            return
        reply: dict[str, Any] = {"seq": msg.get("seq"), "ok": True}
        try:
            if op == "serve":
                if len(fds) != 1:
                    raise OSError("serve without the pod's netns")
                await self.server.serve(str(msg["id"]), str(msg["pod"]), fds.pop())
            elif op == "stop":
                reply["stopped"] = self.server.stop(str(msg["id"]))
            elif op == "linger":
                self.linger = True
            elif op == "stats":
                reply["stats"] = self.server.stats()
            else:
                raise ValueError(f"unknown op {op!r}")
        except (OSError, ValueError, KeyError) as e:
            reply = {"seq": msg.get("seq"), "ok": False, "error": str(e)}
        finally:
            for f in fds:
                os.close(f)
        self._send(reply)


async def _main(fd: int, args: dict[str, Any]) -> None:
    chan = socket.socket(fileno=fd)
    control = Control(chan, args)
    loop = asyncio.get_running_loop()
    loop.add_reader(chan.fileno(), control.on_readable)
    loop.add_signal_handler(signal.SIGTERM, control.done.set)
    await control.done.wait()
    await control.server.drain(DRAIN_S)


def main(argv: list[str]) -> None:
    """``python -m agent.dns.server <cgroup dir or ''> <channel fd> <json settings> <run dir>``
    (the run dir only names the process: ``aether-agent uninstall`` finds it by it)"""
    if argv[0]:
        with open(os.path.join(argv[0], "cgroup.procs"), "w") as f:
            f.write("0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="aether-dns %(levelname)s %(message)s")
    asyncio.run(_main(int(argv[1]), json.loads(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
