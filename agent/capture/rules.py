"""Render a CapturePolicy into the nftables script programmed in the pod netns.

Pure: policy in, text out. The script is one libnftables transaction that creates, deletes
and re-creates the aether table, so applying it twice is the same as applying it once and a
pod is never left with half a table. Rule order is the contract:
proxy RETURN (mark and proxy cgroup) → local RETURN → DNS capture → builtin RETURNs →
annotated RETURNs → redirect.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from agent.capture.policy import BUILTIN_EXCLUDED_V4, BUILTIN_EXCLUDED_V6, CapturePolicy

TABLE_FAMILY = "inet"
TABLE_NAME = "aether"
CHAIN_NAME = "output"


def policy_hash(policy: CapturePolicy) -> str:
    blob = json.dumps(policy.to_json(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _set(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def _quote(text: str) -> str:
    if '"' in text or "\n" in text:
        raise ValueError(f"cgroup path {text!r} cannot be quoted for nft")
    return f'"{text}"'


def _port(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


def render_rules(policy: CapturePolicy) -> list[str]:
    """The chain body, one rule a line, in evaluation order."""
    mark = f"meta mark & 0x{policy.mark_mask:08x} == 0x{policy.mark:08x}"
    if policy.proxy_cgroup:
        # a pod process with CAP_NET_RAW can set the mark; it cannot join the proxy's cgroup
        own = (f'{mark} socket cgroupv2 level {policy.proxy_cgroup_level} '
               f'{_quote(policy.proxy_cgroup)} return comment "proxy upstream (mark + proxy cgroup)"')
    else:
        own = f'{mark} return comment "proxy upstream (mark only: no cgroup v2 match)"'
    rules = [own]
    if policy.proxy_cgroup and policy.peer_cgroup:
        # a take-over: the other agent's Envoy still relays (and opens upstream sockets)
        rules.append(f'{mark} socket cgroupv2 level {policy.peer_cgroup_level} '
                     f'{_quote(policy.peer_cgroup)} return comment '
                     '"proxy upstream of the agent being replaced (mark + its cgroup)"')
    rules.append('fib daddr type local return comment "local destination"')
    if policy.dns_capture:
        # any resolver but the pod's own addresses (loopback included, matched above), even
        # link-local ones (NodeLocal DNSCache): the pod's DNS answers mesh names and forwards
        # the rest from this netns, through the proxy RETURN
        rules += [
            f'udp dport 53 redirect to :{policy.dns_port} comment "dns capture"',
            f'tcp dport 53 tcp flags & (syn | ack) == syn redirect to :{policy.dns_port} '
            'comment "dns capture"',
        ]
    rules += [
        f'ip daddr {_set(list(BUILTIN_EXCLUDED_V4))} return comment "loopback, link-local, multicast"',
        f'ip6 daddr {_set(list(BUILTIN_EXCLUDED_V6))} return comment "loopback, link-local, multicast"',
    ]
    if policy.exclude_v4:
        rules.append(
            f'ip daddr {_set(list(policy.exclude_v4))} return comment "exclude-outbound-ip-ranges"'
        )
    if policy.exclude_v6:
        rules.append(
            f'ip6 daddr {_set(list(policy.exclude_v6))} return comment "exclude-outbound-ip-ranges"'
        )
    if policy.exclude_ports:
        ports = [_port(r) for r in policy.exclude_ports]
        rules.append(f'tcp dport {_set(ports)} return comment "exclude-outbound-ports"')
    # Only a connection's opening SYN is redirected. NAT is decided at the first packet
    # conntrack sees; a connection open before the table existed (a pod enrolled live) is
    # picked up mid-stream by conntrack and must keep its direct path rather than be sent,
    # mid-stream, to a listener that never saw its handshake. No TCP connection opens
    # without a SYN, so nothing new escapes.
    syn = "tcp flags & (syn | ack) == syn"
    if policy.redirect_all:
        rules.append(f'{syn} redirect to :{policy.capture_port} comment "redirect-all"')
    else:
        rules.append(
            f"tcp dport {policy.mesh_port} {syn} redirect to :{policy.capture_port}"
            ' comment "scoped: mesh port"'
        )
    return rules


INBOUND_CHAIN = "inbound"


def render_inbound_rules(policy: CapturePolicy) -> list[str]:
    """STRICT: the prerouting chain that steers every other inbound TCP connection to the
    proxy's inbound listener, which serves only mesh mTLS: plaintext is closed there and
    counted (as an unauthenticated caller), never delivered. Only a new connection's SYN is
    steered (replies to the pod's own connections pass); loopback is the proxy delivering a
    mesh connection; the node's addresses are kubelet's probes. Judged (an
    AuthorizationPolicy selects a PERMISSIVE pod): the same chain, to the proxy's plaintext
    listener instead, which delivers what the policies allow."""
    rules = [
        'meta iifname "lo" return comment "loopback (the proxy delivering)"',
        f'tcp dport {policy.inbound_port} return comment "mesh hop (mTLS)"',
    ]
    if policy.node_sources_v4:
        rules.append(f'ip saddr {_set(list(policy.node_sources_v4))} return '
                     'comment "the node (kubelet probes)"')
    if policy.node_sources_v6:
        rules.append(f'ip6 saddr {_set(list(policy.node_sources_v6))} return '
                     'comment "the node (kubelet probes)"')
    if policy.strict:
        rules.append(f'tcp flags & (syn | ack) == syn redirect to :{policy.inbound_port} '
                     'comment "strict: to the proxy, which accepts only mesh mTLS"')
    else:
        rules.append(f'tcp dport {policy.judge_port} drop '
                     'comment "the judging listener is the proxy\'s, not a caller\'s"')
        rules.append(f'tcp flags & (syn | ack) == syn redirect to :{policy.judge_port} '
                     'comment "judged: to the proxy, which applies the authorization policies"')
    return rules


def render_create(policy: CapturePolicy) -> str:
    """The first ADD into a netns: create the table plainly (fails if one exists, then the
    replace form of render_ruleset applies). Deleting a hooked table inside the replace
    transaction costs the kernel ~10 ms that a fresh netns never needs."""
    # the comment goes with `create` (the body's comment cannot change a table made in the
    # same transaction); the body then adds the chain
    return (f"create table {TABLE_FAMILY} {TABLE_NAME} {{ comment {_comment(policy)}; }}\n"
            + render_table(policy))


def _comment(policy: CapturePolicy) -> str:
    return f'"aether capture {policy.mode} policy {policy_hash(policy)}"'


def render_table(policy: CapturePolicy) -> str:
    """The full table definition (no replace preamble)."""
    body = "\n".join(f"\t\t{r}" for r in render_rules(policy))
    inbound = ""
    if policy.strict or policy.judged:
        rules = "\n".join(f"\t\t{r}" for r in render_inbound_rules(policy))
        inbound = (f"\tchain {INBOUND_CHAIN} {{\n"
                   "\t\ttype nat hook prerouting priority -100; policy accept;\n"
                   f"{rules}\n"
                   "\t}\n")
    return (
        f"table {TABLE_FAMILY} {TABLE_NAME} {{\n"
        f"\tcomment {_comment(policy)}\n"
        f"\tchain {CHAIN_NAME} {{\n"
        "\t\ttype nat hook output priority -100; policy accept;\n"
        f"{body}\n"
        "\t}\n"
        f"{inbound}"
        "}\n"
    )


def render_ruleset(policy: CapturePolicy) -> str:
    """One atomic transaction: ensure the table exists, drop it, define it anew."""
    return (
        f"table {TABLE_FAMILY} {TABLE_NAME}\n"
        f"delete table {TABLE_FAMILY} {TABLE_NAME}\n" + render_table(policy)
    )


RELEASING_COMMENT = "aether releasing"


def render_releasing() -> str:
    """The table a released pod keeps for a few seconds: a nat chain that redirects nothing.
    New connections go direct; connections open through the proxy keep their NAT translation
    until the proxy has closed them. That needs the chain (the NAT hooks) *and* a rule that
    uses conntrack: the kernel unhooks conntrack from a netns when its last user (our
    redirect) goes, and a connection whose packets are no longer tracked is no longer
    translated — Envoy's FIN would never reach the pod. One transaction, like
    render_ruleset."""
    return (
        f"table {TABLE_FAMILY} {TABLE_NAME}\n"
        f"delete table {TABLE_FAMILY} {TABLE_NAME}\n"
        f"table {TABLE_FAMILY} {TABLE_NAME} {{\n"
        f'\tcomment "{RELEASING_COMMENT}: new connections direct, proxied ones closing"\n'
        f"\tchain {CHAIN_NAME} {{\n"
        "\t\ttype nat hook output priority -100; policy accept;\n"
        '\t\tct state new accept comment "keeps conntrack (and NAT) for open connections"\n'
        "\t}\n"
        "}\n"
    )


def render_delete() -> str:
    return f"delete table {TABLE_FAMILY} {TABLE_NAME}\n"


def normalize_listing(listing: dict[str, Any]) -> list[dict[str, Any]]:
    """`nft -j list table` output without handles and metainfo, for drift comparison."""

    def strip(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k != "handle"}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    return [strip(o) for o in listing.get("nftables", []) if "metainfo" not in o]


def fingerprint(listing: dict[str, Any]) -> str:
    blob = json.dumps(normalize_listing(listing), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
