"""What a pod's connection to a destination would hit: a pure mirror of the rule order.

Used by `aether-agent status <ns>/<pod> --dest IP:port` so an operator can ask "why did
this connection (not) go through the mesh?" without reading nftables.
"""

from __future__ import annotations

import ipaddress

from agent.capture.policy import BUILTIN_EXCLUDED_V4, BUILTIN_EXCLUDED_V6, CapturePolicy


def explain_destination(policy: CapturePolicy, pod_ips: list[str], dest_ip: str, dest_port: int,
                        services: dict[tuple[str, int], str] | None = None) -> str:
    """One line: which rule the first packet of a TCP connection to dest matches, and then
    what Envoy does with it (`services` maps (ClusterIP, port) → Service key in scope)."""
    try:
        addr = ipaddress.ip_address(dest_ip)
    except ValueError:
        return f"{dest_ip!r} is not an IP address"
    if dest_ip in pod_ips:
        return "direct: the pod's own address (fib daddr type local)"
    builtin = BUILTIN_EXCLUDED_V4 if addr.version == 4 else BUILTIN_EXCLUDED_V6
    for net in builtin:
        if addr in ipaddress.ip_network(net):
            return f"direct: {net} is always excluded (loopback, link-local, multicast)"
    mine = policy.exclude_v4 if addr.version == 4 else policy.exclude_v6
    for net in mine:
        if addr in ipaddress.ip_network(net):
            return f"direct: {net} is in capture.aether.io/exclude-outbound-ip-ranges"
    for lo, hi in policy.exclude_ports:
        if lo <= dest_port <= hi:
            return f"direct: port {dest_port} is in capture.aether.io/exclude-outbound-ports"
    if not policy.redirect_all and dest_port != policy.mesh_port:
        return f"direct: scoped mode redirects only the mesh port {policy.mesh_port}"
    where = f"redirected to the capture listener on :{policy.capture_port}"
    key = (services or {}).get((str(addr), dest_port))
    if key:
        return f"{where}; Envoy routes it to Service {key} (ClusterIP {dest_ip}:{dest_port})"
    return f"{where}; not an in-scope Service: Envoy passes it through to {dest_ip}:{dest_port}"
