"""Find the network namespace of a running pod the agent never saw an ADD for, by its IP.

A pod older than aether on this node went through no ADD of ours, so nothing recorded its
netns. The runtime pins pod namespaces under /var/run/netns (containerd, CRI-O) and the pod's
processes hold it (/proc/<pid>/ns/net): look at each distinct namespace once (never the
node's own) and match the pod's IPs against the addresses inside it. Addresses are read from
/proc/thread-self/net (the calling thread's namespace), so no process is spawned per netns.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable

from agent.netns.enter import NetnsError, host_netns_identities, netns_identity, run_in_netns

log = logging.getLogger("aether.discover")

PINNED_DIRS = ("/var/run/netns", "/run/netns")


def candidates(pinned_dirs: Iterable[str] = PINNED_DIRS, proc: str = "/proc") -> list[str]:
    """One path per distinct netns that is not the node's own: pinned ones first (stable
    paths), then processes' namespaces."""
    host = host_netns_identities()
    seen: set[tuple[int, int]] = set()
    out: list[str] = []

    def consider(path: str) -> None:
        try:
            ident = netns_identity(path)
        except OSError:
            return
        if ident in host or ident in seen:
            return
        seen.add(ident)
        out.append(path)

    for d in pinned_dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            consider(os.path.join(d, name))
    try:
        pids = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        pids = []
    for pid in sorted(pids, key=int):
        consider(os.path.join(proc, pid, "ns", "net"))
    return out


def parse_fib_trie(text: str) -> set[str]:
    """The local IPv4 addresses in a /proc/net/fib_trie listing ("/32 host LOCAL" leaves)."""
    out: set[str] = set()
    last = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped == "/32 host LOCAL" and last:
            out.add(last)
    return out


def parse_if_inet6(text: str) -> set[str]:
    """The IPv6 addresses in a /proc/net/if_inet6 listing."""
    out: set[str] = set()
    for line in text.splitlines():
        parts = line.split()
        if parts and len(parts[0]) == 32:
            try:
                out.add(str(ipaddress.IPv6Address(int(parts[0], 16))))
            except ValueError:
                continue
    return out


def _addresses_here() -> set[str]:
    out: set[str] = set()
    for name, parse in (("fib_trie", parse_fib_trie), ("if_inet6", parse_if_inet6)):
        try:
            with open(f"/proc/thread-self/net/{name}") as f:
                out |= parse(f.read())
        except OSError:
            continue
    return out


def find_by_ips(ips: dict[str, str], paths: list[str] | None = None) -> dict[str, str]:
    """`ips` maps a pod IP to a key (e.g. the pod's uid); returns key → netns path for each
    key whose IP sits in exactly one namespace (an IP seen in two is ambiguous: skipped)."""
    wanted = {str(ipaddress.ip_address(ip)): key for ip, key in ips.items()}
    found: dict[str, list[str]] = {}
    for path in candidates() if paths is None else paths:
        try:
            here = run_in_netns(path, _addresses_here, timeout=5.0)
        except (NetnsError, OSError, TimeoutError):
            continue
        for ip in here & wanted.keys():
            found.setdefault(wanted[ip], []).append(path)
    out = {}
    for key, where in found.items():
        if len(set(where)) == 1:
            out[key] = where[0]
        else:
            log.warning("pod %s: its IP is in %d network namespaces (%s): not enrolled", key,
                        len(where), ", ".join(where[:3]))
    return out
