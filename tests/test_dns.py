"""The pod DNS's pure parts: the messages it reads and writes, which names it answers, the
conntrack lookup it encodes, and the capture rules and annotation that send DNS to it."""

from __future__ import annotations

import socket
import struct

import pytest

from agent.capture.policy import ANN_DNS, CapturePolicy, decide
from agent.capture.rules import render_rules, render_ruleset
from agent.common.config import NodeConfig
from agent.dns import conntrack, wire
from agent.dns.names import decide as decide_name
from agent.dns.names import wanted
from agent.source.model import NamespaceMeta, PodMeta
from agent.testing.dns_double import addresses

NS = NamespaceMeta("app", labels={"aether.io/managed": "true"})
NODE = NodeConfig(proxy_cgroup="aether-proxy", proxy_cgroup_level=1, dns_capture=True)


def query(name: str, qtype: int = wire.TYPE_A, qid: int = 0x1234, edns: bool = False,
          flags: int = 0x0100) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00"
    extra = b"\x00" + struct.pack("!HHIH", wire.TYPE_OPT, 4096, 0, 0) if edns else b""
    return (wire.HEADER.pack(qid, flags, 1, 0, 0, 1 if edns else 0) + q
            + struct.pack("!HH", qtype, wire.CLASS_IN) + extra)


def answers(msg: bytes) -> tuple[int, int, list[str]]:
    """(flags, rcode, addresses) of a response this module's queries got."""
    rcode, ips, _tc = addresses(msg)
    return wire.HEADER.unpack_from(msg)[1], rcode, ips


def test_a_query_reads_back_with_its_case_folded_and_its_question_kept() -> None:
    q = wire.parse_query(query("Echo.Demo.Aether.Internal", edns=True))
    assert (q.qid, q.name, q.qtype, q.edns_size) == (0x1234, "echo.demo.aether.internal",
                                                      wire.TYPE_A, 4096)
    assert b"Echo" in q.raw_question and q.recursion_desired


@pytest.mark.parametrize("bad", [b"", b"\x00" * 11, query("a.b")[:14],
                                 wire.HEADER.pack(1, 0x8000, 1, 0, 0, 0) + b"\x00\x00\x01\x00\x01",
                                 wire.HEADER.pack(1, 0, 2, 0, 0, 0) + b"\x00\x00\x01\x00\x01",
                                 wire.HEADER.pack(1, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01"])
def test_what_is_not_one_plain_question_is_malformed(bad: bytes) -> None:
    with pytest.raises(wire.MalformedQuery):
        wire.parse_query(bad)


def test_an_answer_echoes_id_question_and_rd_and_holds_the_family_asked() -> None:
    q = wire.parse_query(query("echo.demo.aether.internal", wire.TYPE_A))
    msg = wire.response(q, wire.RCODE_NOERROR, ("10.96.0.7", "fd00::7"))
    flags, rcode, ips = answers(msg)
    assert msg[:2] == b"\x12\x34" and rcode == 0 and ips == ["10.96.0.7"]
    assert flags & 0x8000 and flags & 0x0100 and flags & 0x0400 and flags & 0x0080
    q6 = wire.parse_query(query("echo.demo.aether.internal", wire.TYPE_AAAA))
    assert answers(wire.response(q6, 0, ("10.96.0.7", "fd00::7")))[2] == ["fd00::7"]


def test_an_edns_query_gets_an_opt_record_and_a_plain_one_none() -> None:
    with_opt = wire.response(wire.parse_query(query("a.b.c", edns=True)), 0, ("10.0.0.1",))
    plain = wire.response(wire.parse_query(query("a.b.c")), 0, ("10.0.0.1",))
    assert wire.HEADER.unpack_from(with_opt)[5] == 1 and wire.HEADER.unpack_from(plain)[5] == 0


def test_a_udp_answer_too_big_for_the_client_is_truncated_and_tcp_is_not() -> None:
    q = wire.parse_query(query("big.demo.aether.internal"))
    many = tuple(f"10.96.{i // 256}.{i % 256}" for i in range(60))  # 60 × 16 B > 512
    udp = wire.response(q, 0, many)
    assert answers(udp)[0] & 0x0200 and answers(udp)[2] == [] and len(udp) <= 512
    tcp = wire.response(q, 0, many, udp=False)
    assert not answers(tcp)[0] & 0x0200 and len(answers(tcp)[2]) == 60


def test_an_unreadable_query_gets_formerr_and_a_response_never_an_answer() -> None:
    bad = wire.HEADER.pack(7, 0x0100, 2, 0, 0, 0)
    reply = wire.error_for(bad, wire.RCODE_FORMERR)
    assert reply is not None and reply[:2] == b"\x00\x07" and reply[3] & 0xF == 1
    assert wire.error_for(wire.HEADER.pack(7, 0x8100, 2, 0, 0, 0), 1) is None
    assert wire.error_for(b"\x01", 1) is None


def test_tcp_frames_carry_a_two_octet_length() -> None:
    assert wire.tcp_frame(b"abc") == b"\x00\x03abc"


SERVICES = {("demo", "echo"): ("10.96.0.7",), ("demo", "dual"): ("10.96.0.8", "fd00::8"),
            ("demo", "headless"): ()}


def lookup(ns: str, name: str) -> tuple[str, ...] | None:
    return SERVICES.get((ns, name))


def test_mesh_names_are_answered_from_the_services_and_never_forwarded() -> None:
    v = decide_name("echo.demo.aether.internal", wire.TYPE_A, wire.CLASS_IN,
                    "aether.internal", lookup)
    assert not v.forward and v.addresses == ("10.96.0.7",) and v.kind == "mesh"
    # AAAA of an IPv4-only Service: NOERROR, no records (not forwarded, not NXDOMAIN)
    v6 = decide_name("echo.demo.aether.internal", wire.TYPE_AAAA, wire.CLASS_IN,
                     "aether.internal", lookup)
    assert not v6.forward and v6.rcode == wire.RCODE_NOERROR and v6.addresses == ()
    assert decide_name("dual.demo.aether.internal", wire.TYPE_AAAA, 1, "aether.internal",
                       lookup).addresses == ("fd00::8",)
    assert decide_name("headless.demo.aether.internal", wire.TYPE_A, 1, "aether.internal",
                       lookup).addresses == ()


@pytest.mark.parametrize("name", ["nope.demo.aether.internal", "aether.internal",
                                  "demo.aether.internal", "a.echo.demo.aether.internal"])
def test_other_names_under_the_mesh_domain_do_not_exist(name: str) -> None:
    v = decide_name(name, wire.TYPE_A, wire.CLASS_IN, "aether.internal", lookup)
    assert not v.forward and v.rcode == wire.RCODE_NXDOMAIN


@pytest.mark.parametrize("name", ["echo.demo.svc.cluster.local", "example.com",
                                  "echo.demo.aether.internal.demo.svc.cluster.local",
                                  "xaether.internal", "other.demo.svc.clusterset.local"])
def test_every_other_name_is_forwarded(name: str) -> None:
    assert decide_name(name, wire.TYPE_A, wire.CLASS_IN, "aether.internal", lookup,
                       lambda _ns, _n: None).forward


def test_a_known_import_answers_its_clusterset_name() -> None:
    v = decide_name("echo.demo.svc.clusterset.local", wire.TYPE_A, 1, "aether.internal",
                    lookup, lambda ns, n: ("10.97.0.1",) if (ns, n) == ("demo", "echo") else None)
    assert not v.forward and v.addresses == ("10.97.0.1",) and v.kind == "clusterset"


def test_wanted_names_the_one_lookup_decide_makes() -> None:
    assert wanted("echo.demo.aether.internal", "aether.internal") == ("service", "demo", "echo")
    assert wanted("echo.demo.svc.clusterset.local", "aether.internal") == \
        ("import", "demo", "echo")
    # the standard name: forwarded, its Service readied first (the held first call)
    assert wanted("echo.demo.svc.cluster.local", "aether.internal") == ("hold", "demo", "echo")
    assert wanted("example.com", "aether.internal") is None
    assert wanted("demo.aether.internal", "aether.internal") is None


def test_the_conntrack_get_asks_for_the_reply_tuple_and_reads_the_original() -> None:
    msg = conntrack.encode_get(("127.0.0.1", 15053), ("10.1.0.5", 40000), seq=9)
    length, kind, flags, seq, _pid = struct.unpack_from("=IHHII", msg)
    assert length == len(msg) and kind == (1 << 8) | 1 and flags == 1 and seq == 9
    assert socket.inet_aton("127.0.0.1") in msg and struct.pack("!H", 40000) in msg
    # the kernel's answer: a CT NEW with the original tuple (dst 10.96.0.10:53)
    ip = conntrack._nested(1, conntrack._attr(1, socket.inet_aton("10.1.0.5")),
                           conntrack._attr(2, socket.inet_aton("10.96.0.10")))
    proto = conntrack._nested(2, conntrack._attr(1, b"\x11"),
                              conntrack._attr(2, struct.pack("!H", 40000)),
                              conntrack._attr(3, struct.pack("!H", 53)))
    body = struct.pack("=BBH", 2, 0, 0) + conntrack._nested(1, ip, proto)
    reply = struct.pack("=IHHII", 16 + len(body), 1 << 8, 0, 9, 0) + body
    assert conntrack.decode_original_dst(reply, 9) == ("10.96.0.10", 53)
    enoent = struct.pack("=IHHII", 36, 2, 0, 9, 0) + struct.pack("=i", -2) + msg[:16]
    with pytest.raises(conntrack.NoEntry):
        conntrack.decode_original_dst(enoent, 9)


def _policy(annotations: dict[str, str], node: NodeConfig = NODE) -> CapturePolicy:
    d = decide(PodMeta("app", "p", annotations=annotations), NS, node, True)
    assert d.policy is not None
    return d.policy


def test_dns_is_redirected_after_the_proxy_and_local_returns_and_before_the_rest() -> None:
    rules = render_rules(_policy({}))
    dns = [i for i, r in enumerate(rules) if "dns capture" in r]
    assert [rules[i].split(" redirect")[0] for i in dns] == [
        "udp dport 53", "tcp dport 53 tcp flags & (syn | ack) == syn"]
    assert "socket cgroupv2" in rules[0] and "fib daddr type local" in rules[1]
    assert dns == [2, 3] and all("redirect to :15053" in rules[i] for i in dns)
    # the link-local return comes after: a NodeLocal DNSCache at 169.254.20.10 is captured
    assert any("169.254.0.0/16" in r for r in rules[4:])


def test_the_annotation_opts_a_pod_out_and_a_bad_value_keeps_dns_captured() -> None:
    assert "dns capture" not in render_ruleset(_policy({ANN_DNS: "false"}))
    d = decide(PodMeta("app", "p", annotations={ANN_DNS: "maybe"}), NS, NODE, True)
    assert d.policy is not None and d.policy.dns_capture
    assert [p.annotation for p in d.problems] == [ANN_DNS]
    off = NodeConfig(dns_capture=False)
    assert not _policy({ANN_DNS: "true"}, off).dns_capture  # the node's --no-dns-capture wins


def test_the_policy_records_dns_capture_and_keeps_old_hashes_without_it() -> None:
    on = _policy({})
    assert CapturePolicy.from_json(on.to_json()) == on
    off = _policy({ANN_DNS: "false"})
    assert "dns_capture" not in off.to_json()
    assert CapturePolicy.from_json(off.to_json()) == off
