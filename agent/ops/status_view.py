"""Human rendering of the status document: a summary first, then tables."""

from __future__ import annotations

from typing import Any


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def identity_lines(ident: dict[str, Any]) -> list[str]:
    """SVIDs held: who, until when, which pods; what is missing and why."""
    svids = ident.get("svids") or []
    lines = [f"  mesh identity: {ident.get('provider')} · trust domain "
             f"{ident.get('trust_domain')} · {len(svids)} SVID(s) · rotations "
             f"{ident.get('rotations', 0)}"]
    rows = []
    for r in svids:
        left = r.get("seconds_left")
        rows.append([r["identity"], r.get("spiffe_id") or "NONE (pods fail closed)",
                     "-" if left is None else _duration(float(left)),
                     ", ".join(r.get("pods") or []) or "-",
                     r.get("error") or ""])
    if rows:
        lines += ["    " + ln for ln in _table(
            ["IDENTITY", "SPIFFE ID", "EXPIRES IN", "PODS", "ERROR"], rows).splitlines()]
    accepted = (ident.get("accepted") or {}).get("inbound") or []
    if accepted:
        top = sorted(accepted, key=lambda r: -int(r["connections"]))[:TOP_CALLERS]
        lines.append(f"  mesh connections accepted, by caller (top {len(top)} of "
                     f"{len(accepted)}; all on /metrics):")
        lines += ["    " + ln for ln in _table(
            ["IDENTITY", "CALLER", "CONNECTIONS", "BYTES IN", "BYTES OUT"],
            [[r["identity"], r["caller"], str(r["connections"]), str(r["received_bytes"]),
              str(r["sent_bytes"])] for r in top]).splitlines()]
    return lines


TOP_CALLERS = 10


def meshpod_lines(mp: dict[str, Any] | None, kinds: dict[str, int]) -> list[str]:
    """Where other nodes' pods come from, and this node's published records."""
    if not mp:
        return []
    mode = mp.get("remote_pods")
    held = (f"{kinds.get('MeshPod', 0)} MeshPod records read" if mode == "meshpods"
            else f"{kinds.get('Pod', 0)} Pods listed cluster-wide")
    lines = [f"remote pods: --remote-pods {mode} · {held} · this node publishes "
             f"{len(mp.get('owned') or [])} (writes {mp.get('writes', 0)}, failures "
             f"{mp.get('failures', 0)})"]
    if mp.get("last_error"):
        lines.append(f"  MESHPOD PUBLISHING FAILS: {mp['last_error']}")
    return lines


# Envoy's ACKed versions are keyed by type URL; a person reads the resource kind.
_KINDS = (("Cluster", "clusters"), ("Listener", "listeners"),
          ("ClusterLoadAssignment", "endpoints"), ("RouteConfiguration", "routes"),
          ("Secret", "secrets"))


def acked_versions(acked: object) -> str:
    """``clusters v7, listeners v7, endpoints v6, secrets v7`` from {type URL: version}."""
    if not isinstance(acked, dict) or not acked:
        return "none yet" if not acked else str(acked)
    names = {kind: plural for kind, plural in _KINDS}
    order = [plural for _kind, plural in _KINDS]
    parts: list[tuple[int, str]] = []
    for url, version in acked.items():
        kind = str(url).rsplit(".", 1)[-1]
        label = names.get(kind, kind)
        rank = order.index(label) if label in order else len(order)
        parts.append((rank, f"{label} v{version}"))
    return ", ".join(text for _rank, text in sorted(parts))


def _duration(seconds: float) -> str:
    if seconds < 0:
        return "expired"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def takeover_lines(t: dict[str, Any]) -> list[str]:
    """Which agent serves and, during a take-over, the one being replaced and its drain."""
    old = t.get("replaced")
    if not old:
        return []
    line = (f"  take-over: serving as {t.get('instance')} (pid {t.get('pid')}, Envoy slot "
            f"{t.get('slot')}), replacing {old.get('instance')} (pid {old.get('pid')}, "
            f"{old.get('version')}): {old.get('state')}")
    if old.get("state") == "draining":
        left = old.get("connections_left")
        secs = old.get("seconds_left")
        line += (f" · {'?' if left is None else left} connections left · "
                 + ("drain clock starts at its SIGTERM" if secs is None else f"{secs}s left"))
    return [line]


def dns_lines(dns: dict[str, Any] | None) -> list[str]:
    """The pod DNS in one line: up or not, pods served, and what it did with the queries."""
    if not dns:
        return ["  pod DNS: not captured (--no-dns-capture)"]
    if not dns.get("up"):
        return [f"  pod DNS: DOWN ({dns.get('error')}) · {dns.get('served', 0)} pods to serve"]
    totals: dict[str, int] = {}
    for counts in (dns.get("pods") or {}).values():
        for k, v in counts.items():
            if k != "inflight":
                totals[k] = totals.get(k, 0) + int(v)
    what = ", ".join(f"{k} {v}" for k, v in sorted(totals.items())) or "no queries yet"
    return [f"  pod DNS: pid {dns.get('pid')} · port {dns.get('port')} · "
            f"{dns.get('served', 0)} pods · {what}"]


def render(st: dict[str, Any]) -> str:
    pods = st.get("pods", [])
    state = "DEGRADED" if st.get("degraded") else "healthy"
    lines = [
        f"aether-agent {st.get('version')} on {st.get('node')}: {state}",
        f"  uptime {st.get('uptime_s')}s · source: {st.get('source')} · run dir {st.get('run_dir')}",
        f"  captured pods: {len(pods)}",
    ]
    integrity = st.get("capture_integrity") or {}
    if integrity:
        lines.append(f"  capture integrity: proxy RETURN by {integrity.get('proxy_match')}"
                     + (f" · DEGRADED: {integrity['problem']}" if integrity.get("problem") else ""))
    lines.extend(takeover_lines(st.get("takeover") or {}))
    lines.extend(dns_lines(st.get("dns")))
    envoy = st.get("envoy")
    if envoy:
        lines.append(
            f"  envoy: pid {envoy.get('pid')} · ready {envoy.get('ready')} · restarts "
            f"{envoy.get('restarts')} · rss {int(envoy.get('rss_bytes') or 0) // (1 << 20)} MiB"
            f" · acked: {acked_versions(envoy.get('acked_version'))}"
            f" · nacks {envoy.get('nack_count', 0)}"
        )
        if envoy.get("admin"):
            lines.append(f"    admin: {envoy['admin']}")
        if envoy.get("pending_removals"):
            lines.append(f"    listener removals not yet ACKed by Envoy: "
                         f"{', '.join(envoy['pending_removals'])}")
        if envoy.get("last_nack"):
            lines.append(f"    last NACK: {envoy['last_nack']}")
        ident = envoy.get("identity")
        lines.extend(identity_lines(ident) if ident else
                     ["  mesh identity: none (no provider: the mesh hop is plaintext)"])
    ci = st.get("cni_install") or {}
    if ci:
        last = ci.get("last_repair") or {}
        lines.append(
            f"  cni: conflist {ci.get('conflist') or 'none yet'} · entry "
            f"{'present' if ci.get('entry_present') else 'MISSING'} · plugin "
            f"{'present' if ci.get('plugin_present') else 'missing'} · repairs "
            f"{ci.get('repairs') if ci.get('repairs') is not None else '-'}"
            + (f" (last: {', '.join(last.get('what') or [])})" if last else ""))
    c = st.get("counters", {})
    lines.append("  requests: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    live = st.get("live_enrollment") or {}
    if live.get("enabled"):
        lines.append(f"  live enrollment: on · {live.get('watched_uncaptured', 0)} uncaptured "
                     f"pods watched · {live.get('discovered', 0)} found by IP")
        for key in live.get("not_found") or []:
            lines.append(f"  TO CAPTURE, NETNS NOT FOUND BY IP: {key}")
    busy = st.get("refused_busy") or {}
    if any(busy.values()):
        lines.append("  refused as busy (connection cap): "
                     + ", ".join(f"{k} {v}" for k, v in busy.items()))
    lines.append("")
    if pods:
        rows = [[p["pod"], p["mode"], p["rules"], p.get("listener", "-"),
                 ",".join(p["exclude_ports"]) or "-", ",".join(p["exclude_cidrs"]) or "-",
                 ",".join(p["ips"]) or "-"] for p in pods]
        lines.append(_table(["POD", "MODE", "RULES", "LISTENER", "EXCL PORTS", "EXCL CIDRS", "IPS"],
                            rows))
        # the listener as Envoy holds it; anything but live says why
        for p in pods:
            if p.get("listener") not in ("live", "n/a (no proxy)", None):
                lines.append(f"  LISTENER {str(p['listener']).upper()}: {p['pod']}: "
                             f"{p.get('listener_detail') or '-'}")
    mesh = st.get("mesh")
    if mesh:
        deps = mesh.get("dependency_set") or {}
        lines.append("")
        lines.append(f"dependency set: {mesh.get('dependency_set_size')} served · source "
                     f"{mesh.get('source')} · {mesh.get('objects')} objects · pushes "
                     f"{mesh.get('pushes')} (last {mesh.get('last_push_ms')} ms)")
        for key, why in list(deps.items())[:50]:
            lines.append(f"  {key}: {'; '.join(why)}")
        if len(deps) > 50:
            lines.append(f"  … {len(deps) - 50} more (use --json)")
        targets = mesh.get("route_targets") or {}
        if targets:
            lines.append(f"route targets: {len(targets)}")
            for t, routes in list(targets.items())[:30]:
                lines.append(f"  {t}: {', '.join(routes)}")
        for prob in (mesh.get("route_problems") or [])[:30]:
            lines.append(f"  ROUTE PROBLEM: {prob}")
        authz = mesh.get("authorization") or {}
        if authz.get("policies"):
            lines.append(f"authorization policies: {authz['policies']} · selecting "
                         f"{authz.get('pods_selected', 0)} pod(s) here")
        for prob in (authz.get("problems") or [])[:30]:
            lines.append(f"  POLICY PROBLEM: {prob}")
    lines += meshpod_lines(st.get("meshpods"), (mesh or {}).get("objects_by_kind") or {})
    for miss in st.get("capture_missing") or []:
        lines.append(f"  CAPTURE MISSING: {miss}")
    warnings = st.get("warnings", [])
    if warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  {w['pod']}: {w['reason']}: {w['message']}" for w in warnings[-20:]]
    source_problems = st.get("source_problems") or []
    if source_problems:
        lines.append("")
        lines.append("source problems:")
        lines += [f"  {m}" for m in source_problems[:30]]
    if st.get("reconcile"):
        lines.append("")
        lines.append("at startup:")
        lines += [f"  {m}" for m in st["reconcile"]]
    return "\n".join(lines)


def _render_authz(a: dict[str, Any]) -> list[str]:
    policies = a.get("policies") or []
    if not policies:
        return ["  authorization: no policy selects it (every caller allowed)"]
    lines = [f"  authorization: {len(policies)} polic{'y' if len(policies) == 1 else 'ies'}"
             + (" · plaintext inbound judged" if a.get("plaintext_judged") else "")]
    for pol in policies:
        lines.append(f"    {pol['policy']:<32} {pol['action']:<6} {pol['rules']} rule(s)"
                     + (f"  UNREADABLE: {pol['error']}" if pol.get("error") else ""))
        lines += [f"      L4: {note}" for note in pol.get("l4") or []]
    f = a.get("from")
    if f:
        port = f" port {f['port']}" if f.get("port") else ""
        lines.append(f"  from {f['caller']}{port}: {'ALLOWED' if f['allowed'] else 'DENIED'}"
                     f" ({f['reason']})"
                     + (f", audited by {', '.join(f['audited'])}" if f.get("audited") else ""))
    return lines


def render_pod(p: dict[str, Any]) -> str:
    lines = [
        f"pod {p['pod']} ({p['mode']}, {p['reason']})",
        f"  container {p['container_id']} · netns {p['netns']} · ips {', '.join(p['ips']) or '-'}",
        f"  rules: {p['rules_verified']} · listener {p['listener']}: "
        + str(p.get("listener_state") or "unknown")
        + (f" ({p['listener_detail']})" if p.get("listener_detail") else ""),
    ]
    for prob in p.get("problems") or []:
        lines.append(f"  annotation problem: {prob}")
    if p.get("dest"):
        lines.append(f"  {p['dest']['address']} → {p['dest']['verdict']}")
    lines += _render_authz(p.get("authorization") or {})
    if p.get("rules"):
        lines.append("")
        lines.append(str(p["rules"]).rstrip())
    return "\n".join(lines)
