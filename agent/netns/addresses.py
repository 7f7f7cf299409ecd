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
    """Every address of the netns the agent runs in (the node's, as a hostNetwork pod)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        raw = [m.get_attr("IFA_ADDRESS") for m in ipr.get_addr()]
    return usable([a for a in raw if a])


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
