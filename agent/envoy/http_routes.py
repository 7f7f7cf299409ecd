"""Pure rendering of GAMMA route tables (``agent.scope.route_tables``) into Envoy HTTP protos.

One ``RouteConfiguration`` per table with a single ``*`` virtual host: the route was already
chosen by the destination ClusterIP:port (the filter chain match), never by the Host header,
and mesh ``hostnames`` infer nothing. Entries keep the table's precedence order, and a final
catch-all answers the table's no-match status (404). The route config is inlined in the HCM
(one resource per listener, no RDS ordering to get right); ``validate_clusters`` is off so a
route may name a cluster that does not exist — that is how an invalid backendRef's weighted
share gets its 500 (``cluster_not_found_response_code``), and it keeps a listener from being
NACKed while a new backend's cluster is still on its way.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, protocol_pb2
from envoy.config.listener.v3 import listener_components_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.http.stateful_session.v3 import stateful_session_pb2
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.stateful_session.cookie.v3 import cookie_pb2 as session_cookie_pb2
from envoy.extensions.http.stateful_session.header.v3 import header_pb2 as session_header_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.http.v3 import cookie_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from envoy.type.v3 import percent_pb2, range_pb2

from agent.envoy.pieces import (
    STRING_STATE_FACTORY,
    TRANSITIVE,
    duration,
    set_filter_state,
    state_value,
)
from agent.scope.model import ServiceView
from agent.scope.route_tables import (
    GRPC_ROUTE,
    HTTP_ROUTE,
    Backend,
    HeaderModifier,
    Match,
    PathMatch,
    PathModifier,
    Redirect,
    RouteTable,
    Rule,
)
from agent.scope.services import ServicePort, SessionPersistence

ClusterNameFn = Callable[[str, str, int], str]
TcpChainFn = Callable[[ServiceView, ServicePort], listener_components_pb2.FilterChain]

HCM_FILTER = "envoy.filters.network.http_connection_manager"
HTTP_INSPECTOR = "envoy.filters.listener.http_inspector"
HTTP_PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Names a cluster that never exists: the weighted share of an unresolvable backendRef.
INVALID_CLUSTER_PREFIX = "aether-invalid-backend|"
DETECTED_PROTOCOLS = ("http/1.1", "h2c")

# appProtocol values that mean "speak HTTP here" / "h2c prior knowledge upstream".
HTTP_APP_PROTOCOLS = frozenset({"http", "http2", "h2c", "grpc", "grpc-web", "kubernetes.io/h2c",
                                "kubernetes.io/ws"})
H2C_APP_PROTOCOLS = frozenset({"http2", "h2c", "grpc", "kubernetes.io/h2c"})

_REDIRECT_CODES = {
    301: rc.RedirectAction.MOVED_PERMANENTLY,
    302: rc.RedirectAction.FOUND,
    303: rc.RedirectAction.SEE_OTHER,
    307: rc.RedirectAction.TEMPORARY_REDIRECT,
    308: rc.RedirectAction.PERMANENT_REDIRECT,
}
_WELL_KNOWN = {"http": 80, "https": 443}
# :authority without a port (a bracketed IPv6 literal or a name), optionally with ":80".
_NO_PORT = r"(\[[^\]]*\]|[^:\[\]]*)"


def _regex(pattern: str) -> regex_pb2.RegexMatcher:
    return regex_pb2.RegexMatcher(regex=pattern)


def _literal(value: str) -> str:
    """Header values are substitution formats in Envoy: a literal '%' must be doubled."""
    return value.replace("%", "%%")


def invalid_cluster_name(b: Backend) -> str:
    return f"{INVALID_CLUSTER_PREFIX}{b.namespace}|{b.name}|{b.port or 0}"


# ---- matches -------------------------------------------------------------------------------


def _string_match(value: str, regex: bool) -> string_pb2.StringMatcher:
    if regex:
        return string_pb2.StringMatcher(safe_regex=_regex(value))
    return string_pb2.StringMatcher(exact=value)


def _grpc_path(m: Match, route_match: rc.RouteMatch) -> None:
    g = m.grpc
    assert g is not None
    if g.regex:
        svc = f"(?:{g.service})" if g.service else "[^/]+"
        meth = f"(?:{g.method})" if g.method else "[^/]+"
        route_match.safe_regex.CopyFrom(_regex(f"^/{svc}/{meth}$"))
    elif g.service and g.method:
        route_match.path = f"/{g.service}/{g.method}"
    elif g.service:
        route_match.prefix = f"/{g.service}/"
    elif g.method:
        route_match.safe_regex.CopyFrom(_regex(f"^/[^/]+/{re.escape(g.method)}$"))
    else:
        route_match.prefix = "/"


def route_match(m: Match) -> rc.RouteMatch:
    """HTTPRouteMatch/GRPCRouteMatch → RouteMatch (PathPrefix = whole path segments)."""
    out = rc.RouteMatch()
    if m.grpc is not None:
        _grpc_path(m, out)
    else:
        p = m.path
        if p is None or (p.kind == "PathPrefix" and p.value == "/"):
            out.prefix = "/"
        elif p.kind == "Exact":
            out.path = p.value
        elif p.kind == "PathPrefix":
            out.path_separated_prefix = p.value
        else:
            out.safe_regex.CopyFrom(_regex(p.value))
    if m.method:
        out.headers.add(name=":method", string_match=string_pb2.StringMatcher(exact=m.method))
    for h in m.headers:
        out.headers.add(name=h.name.lower(), string_match=_string_match(h.value, h.regex))
    for q in m.query:
        out.query_parameters.add(name=q.name, string_match=_string_match(q.value, q.regex))
    return out


# ---- filters -------------------------------------------------------------------------------


def _header_options(mod: HeaderModifier) -> list[base_pb2.HeaderValueOption]:
    opts = [base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=k, value=_literal(v)),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in mod.set]
    opts += [base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=k, value=_literal(v)),
        append_action=base_pb2.HeaderValueOption.APPEND_IF_EXISTS_OR_ADD) for k, v in mod.add]
    return opts


def _apply_headers(target: rc.Route | rc.WeightedCluster.ClusterWeight,
                   request: HeaderModifier | None, response: HeaderModifier | None) -> None:
    if request is not None:
        target.request_headers_to_add.extend(_header_options(request))
        target.request_headers_to_remove.extend(request.remove)
    if response is not None:
        target.response_headers_to_add.extend(_header_options(response))
        target.response_headers_to_remove.extend(response.remove)


def _prefix_replacement(m: Match, mod: PathModifier, target: rc.RouteAction | rc.RedirectAction
                        ) -> None:
    """ReplacePrefixMatch with the spec's trailing-slash table (whole segments).

    prefix_rewrite alone would turn /foo/bar with replacement "/" into "//bar", so an empty
    or "/" replacement strips the prefix and any slashes after it with a regex instead.
    """
    prefix = m.path.value if m.path is not None else "/"
    repl = mod.value.rstrip("/")
    if prefix == "/":
        if repl:
            target.regex_rewrite.pattern.CopyFrom(_regex("^/"))
            target.regex_rewrite.substitution = repl + "/"
        return
    if repl:
        target.prefix_rewrite = repl
    else:
        target.regex_rewrite.pattern.CopyFrom(_regex(f"^{re.escape(prefix)}/*"))
        target.regex_rewrite.substitution = "/"


def _full_path(mod: PathModifier, target: rc.RouteAction) -> None:
    target.regex_rewrite.pattern.CopyFrom(_regex("^/.*$"))
    target.regex_rewrite.substitution = mod.value


def redirect_variants(r: Redirect, m: Match, service_port: int, hosts: Sequence[str] = ()
                      ) -> list[tuple[str | None, rc.RedirectAction]]:
    """(authority regex or None, RedirectAction) pairs giving the spec's Location header.

    Port: explicit, else the scheme's well-known port when a scheme is set, else the Service
    port (the mesh's "listener port"); it is left out for http:80 and https:443. Envoy keeps
    the request's host:port unless told otherwise and always prints ``port_redirect``, so when
    the port must be omitted and the host is the request's own, a first variant (request
    authority has no port) redirects untouched and a fallback variant forces the right port.
    """
    scheme = r.scheme or "http"  # the mesh hop is plaintext: the request scheme is http
    port = r.port or (_WELL_KNOWN[r.scheme] if r.scheme else service_port)
    omit = _WELL_KNOWN.get(scheme) == port
    base = rc.RedirectAction(response_code=_REDIRECT_CODES[r.status])
    if r.scheme:
        base.scheme_redirect = r.scheme
    if r.path is not None:
        if r.path.kind == "ReplaceFullPath":
            base.path_redirect = r.path.value
        else:
            _prefix_replacement(m, r.path, base)
    if r.hostname:
        base.host_redirect = r.hostname  # Envoy drops the request's port with a new host
    if not omit:
        base.port_redirect = port
        return [(None, base)]
    if r.hostname:
        return [(None, base)]
    # Envoy strips a request ":80" itself when the scheme changes away from http.
    portless = f"^{_NO_PORT}(:80)?$" if scheme != "http" else f"^{_NO_PORT}$"
    out: list[tuple[str | None, rc.RedirectAction]] = [(portless, base)]
    # The target's own names (and ClusterIPs) with any port: a new host without a port makes
    # Envoy drop the request's port, giving the exact Location (https://echo/… for echo:8081).
    for host in hosts:
        named = rc.RedirectAction()
        named.CopyFrom(base)
        named.host_redirect = host
        out.append((f"^{re.escape(host)}:[0-9]+$", named))
    fallback = rc.RedirectAction()
    fallback.CopyFrom(base)
    fallback.port_redirect = port  # an unknown host with a port: correct, but printed
    out.append((None, fallback))
    return out


def _fraction(num: int, den: int) -> percent_pb2.FractionalPercent:
    units = {100: percent_pb2.FractionalPercent.HUNDRED,
             10000: percent_pb2.FractionalPercent.TEN_THOUSAND,
             1000000: percent_pb2.FractionalPercent.MILLION}
    if den in units:
        return percent_pb2.FractionalPercent(numerator=num, denominator=units[den])
    return percent_pb2.FractionalPercent(numerator=round(num * 1_000_000 / den),
                                         denominator=percent_pb2.FractionalPercent.MILLION)


# ---- actions -------------------------------------------------------------------------------


def _route_action(rule: Rule, cluster_name: ClusterNameFn) -> rc.RouteAction:
    code = (rc.RouteAction.SERVICE_UNAVAILABLE if rule.kind == GRPC_ROUTE
            else rc.RouteAction.INTERNAL_SERVER_ERROR)
    action = rc.RouteAction(cluster_not_found_response_code=code)
    live = [b for b in rule.backends if b.weight > 0]  # weight 0 never receives traffic
    plain = (len(live) == 1 and live[0].valid and live[0].request_headers is None
             and live[0].response_headers is None and live[0].host_rewrite is None)
    if plain:
        action.cluster = cluster_name(live[0].namespace, live[0].name, live[0].port or 0)
    else:
        for b in live:
            cw = action.weighted_clusters.clusters.add(
                name=(cluster_name(b.namespace, b.name, b.port or 0) if b.valid
                      else invalid_cluster_name(b)))
            cw.weight.value = b.weight
            if b.valid:
                _apply_headers(cw, b.request_headers, b.response_headers)
                if b.host_rewrite:
                    cw.host_rewrite_literal = b.host_rewrite
    # Unset request timeout: disabled, not Envoy's 15 s default (mesh streams, gRPC).
    action.timeout.CopyFrom(duration(rule.request_timeout_s or 0.0))
    # A backend Service with sessionAffinity: ClientIP hashes (Maglev) on the caller pod's
    # address; other clusters balance round robin and ignore the hash
    action.hash_policy.add().connection_properties.source_ip = True
    retry = rule.retry
    if retry is not None or rule.backend_timeout_s is not None:
        policy = action.retry_policy
        if retry is not None:
            on = ["connect-failure", "refused-stream", "reset"]
            if retry.codes:
                on.append("retriable-status-codes")
                policy.retriable_status_codes.extend(retry.codes)
            policy.retry_on = ",".join(on)
            if retry.attempts is not None:
                policy.num_retries.value = retry.attempts
            if retry.backoff_s:
                policy.retry_back_off.base_interval.CopyFrom(duration(retry.backoff_s))
        else:
            policy.num_retries.value = 0
        if rule.backend_timeout_s:
            policy.per_try_timeout.CopyFrom(duration(rule.backend_timeout_s))
    for mirror in rule.mirrors:
        b = mirror.backend
        mp = action.request_mirror_policies.add(
            cluster=cluster_name(b.namespace, b.name, b.port or 0))
        if mirror.numerator != mirror.denominator:  # unset runtime_fraction = 100%
            mp.runtime_fraction.default_value.CopyFrom(_fraction(mirror.numerator, mirror.denominator))
    if rule.rewrite is not None:
        if rule.rewrite.hostname:
            action.host_rewrite_literal = rule.rewrite.hostname
        if rule.rewrite.path is not None:
            if rule.rewrite.path.kind == "ReplaceFullPath":
                _full_path(rule.rewrite.path, action)
            else:
                _prefix_replacement(rule.match, rule.rewrite.path, action)
    return action


def envoy_routes(rule: Rule, service_port: int, cluster_name: ClusterNameFn,
                 hosts: Sequence[str] = ()) -> list[rc.Route]:
    """One table entry → one Envoy route (two for some redirects, see redirect_variants)."""
    name = f"{rule.route_key}|{rule.name or rule.rule_index}|{rule.match_index}"
    match = route_match(rule.match)
    routes: list[rc.Route] = []
    if rule.direct_status is not None:
        routes.append(rc.Route(name=name, match=match,
                               direct_response=rc.DirectResponseAction(status=rule.direct_status)))
    elif rule.redirect is not None:
        for authority, action in redirect_variants(rule.redirect, rule.match, service_port, hosts):
            m = rc.RouteMatch()
            m.CopyFrom(match)
            if authority is not None:
                m.headers.add(name=":authority",
                              string_match=string_pb2.StringMatcher(safe_regex=_regex(authority)))
            routes.append(rc.Route(name=name, match=m, redirect=action))
    else:
        routes.append(rc.Route(name=name, match=match, route=_route_action(rule, cluster_name)))
    session = rule.effective_session
    for r in routes:
        _apply_headers(r, rule.request_headers, rule.response_headers)
        if session is not None and r.HasField("route"):
            per_route = stateful_session_pb2.StatefulSessionPerRoute()
            per_route.stateful_session.CopyFrom(stateful_session(session))
            r.typed_per_filter_config[STATEFUL_SESSION_FILTER].Pack(per_route)
    return routes


def route_configuration(table: RouteTable, cluster_name: ClusterNameFn, *, name: str | None = None,
                        hosts: Sequence[str] = ()) -> route_pb2.RouteConfiguration:
    """The table as one ``*`` virtual host, ending in a catch-all ``no_match_status``."""
    vh = rc.VirtualHost(name=table.name, domains=["*"])
    for rule in table.rules:
        vh.routes.extend(envoy_routes(rule, table.port, cluster_name, hosts))
    vh.routes.add(name="no-match", match=rc.RouteMatch(prefix="/"),
                  direct_response=rc.DirectResponseAction(status=table.no_match_status))
    cfg = route_pb2.RouteConfiguration(name=name or table.name, virtual_hosts=[vh])
    cfg.validate_clusters.value = False
    return cfg


STATEFUL_SESSION_FILTER = "envoy.filters.http.stateful_session"


def stateful_session(session: SessionPersistence) -> stateful_session_pb2.StatefulSession:
    """Envoy's stateful session: the answer carries the endpoint (a cookie, or a header the
    client sends back), and a request carrying it goes to that endpoint while it is healthy
    (else the load balancer picks, and the session moves). Not strict: a stale session is
    never an error."""
    cfg = stateful_session_pb2.StatefulSession()
    if session.kind == "Header":
        state = session_header_pb2.HeaderBasedSessionState(name=session.name)
        cfg.session_state.name = "envoy.http.stateful_session.header"
    else:
        cookie = cookie_pb2.Cookie(name=session.name, path=session.path)
        if session.ttl_s:
            cookie.ttl.CopyFrom(duration(session.ttl_s))
        state = session_cookie_pb2.CookieBasedSessionState(cookie=cookie)
        cfg.session_state.name = "envoy.http.stateful_session.cookie"
    cfg.session_state.typed_config.Pack(state)
    return cfg


def stateful_session_filter() -> hcm_pb2.HttpFilter:
    """The stateful-session filter with no session of its own: only routes that carry one
    (``envoy_routes``: the rule's, else its backend Service's) keep sessions."""
    f = hcm_pb2.HttpFilter(name=STATEFUL_SESSION_FILTER)
    f.typed_config.Pack(stateful_session_pb2.StatefulSession())
    return f


def hcm_for(table: RouteTable, cluster_name: ClusterNameFn, *, stat_prefix: str | None = None,
            access_log: Sequence[accesslog_pb2.AccessLog] = (), hosts: Sequence[str] = ()
            ) -> hcm_pb2.HttpConnectionManager:
    """HCM with the inline route table; codec AUTO serves HTTP/1.1 and h2c prior knowledge.
    The stateful-session filter (before the router) only where a route keeps sessions."""
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=stat_prefix or table.name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=route_configuration(table, cluster_name, hosts=hosts),
        access_log=list(access_log),
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="websocket")],
    )
    if any(rule.effective_session is not None for rule in table.rules):
        hcm.http_filters.append(stateful_session_filter())
    router = hcm.http_filters.add(name="envoy.filters.http.router")
    # no x-envoy-* headers towards the app or back to the caller: a transparent proxy adds
    # nothing the application did not ask for
    router.typed_config.Pack(router_pb2.Router(suppress_envoy_headers=True))
    # a request id only where the caller sent one (it passes through): inventing one per
    # request is a UUID each, most of the HTTP codec's cost here, for a tracing setup that
    # does not exist
    hcm.generate_request_id.value = False
    hcm.server_header_transformation = hcm_pb2.HttpConnectionManager.PASS_THROUGH
    return hcm


# Set (transitive) by every HTTP chain of a capture path: its requests were parsed, and
# counted, by the caller's proxy. ``mtls-out`` then asks for aether-mesh-http whatever the
# cluster's port declares, so the destination neither detects nor counts them again.
HTTP_HOP_STATE = "aether.http_hop"


@functools.cache
def http_hop_state() -> listener_components_pb2.Filter:
    """The filter an HTTP chain of a capture path runs first (see ``HTTP_HOP_STATE``)."""
    return set_filter_state(state_value(HTTP_HOP_STATE, "1", STRING_STATE_FACTORY, TRANSITIVE))


def http_filter_chain(name: str, match: listener_components_pb2.FilterChainMatch,
                      hcm: hcm_pb2.HttpConnectionManager) -> listener_components_pb2.FilterChain:
    f = listener_components_pb2.Filter(name=HCM_FILTER)
    f.typed_config.Pack(hcm)
    chain = listener_components_pb2.FilterChain(name=name, filters=[http_hop_state(), f])
    chain.filter_chain_match.CopyFrom(match)
    return chain


# ---- per Service port ----------------------------------------------------------------------


def port_protocol(port: ServicePort) -> str:
    """'http' (appProtocol says HTTP), 'tcp' (says something else) or 'detect' (unset)."""
    if port.app_protocol is None:
        return "detect"
    return "http" if port.app_protocol.lower() in HTTP_APP_PROTOCOLS else "tcp"


def service_port_chains(view: ServiceView, port: ServicePort, table: RouteTable | None, *,
                        tcp_chain: TcpChainFn, cluster_name: ClusterNameFn,
                        access_log: Sequence[accesslog_pb2.AccessLog] = ()
                        ) -> list[listener_components_pb2.FilterChain]:
    """Filter chains for one Service port: the L4 chain, the HTTP chain, or both.

    No table (no accepted route on this port for this caller) keeps the identity route,
    which is the plain L4 chain. With a table: appProtocol HTTP → [HCM]; non-HTTP
    appProtocol → [L4] (routes cannot apply); unset → [HCM for http/1.1|h2c, L4 fallback],
    which needs ``http_inspector_listener_filter`` on the listener.
    """
    tcp = tcp_chain(view, port)
    proto = port_protocol(port)
    if table is None and balances_per_request(port):
        table = default_table(view, port)
    if table is None or proto == "tcp":
        return [tcp]
    match = listener_components_pb2.FilterChainMatch()
    match.CopyFrom(tcp.filter_chain_match)
    if proto == "detect":
        match.application_protocols.extend(DETECTED_PROTOCOLS)
    chain = http_filter_chain(f"{tcp.name}|http", match,
                              hcm_for(table, cluster_name, access_log=access_log,
                                      hosts=target_hosts(view)))
    return [chain] if proto == "http" else [chain, tcp]


def balances_per_request(port: ServicePort) -> bool:
    """Ports that declare HTTP (appProtocol http, http2, h2c, grpc, …) get the HTTP codec
    even without a route: requests are balanced one by one (one long-lived gRPC connection
    is spread over every endpoint, not pinned to one) and counted with their status and
    duration (the golden metrics)."""
    return port_protocol(port) == "http"


def default_table(view: ServiceView, port: ServicePort) -> RouteTable:
    """What a Service port with no route does over HTTP: every request to the Service
    itself, no timeout (streams), no retries: the L4 behaviour, per request."""
    rule = Rule(kind=HTTP_ROUTE, route_key=f"default|{view.key}", rule_index=0, match_index=0,
                match=Match(path=PathMatch("PathPrefix", "/")),
                backends=(Backend(view.namespace, view.name, port.port,
                                  app_protocol=port.app_protocol,
                                  session=view.traffic.session),))
    return RouteTable(target=view.key, port=port.port, scope=None, kind=HTTP_ROUTE,
                      rules=(rule,), routes=())


def target_hosts(view: ServiceView) -> list[str]:
    """Names a client may put in Host for this Service: the short and DNS-search forms, the
    FQDNs, and the ClusterIPs (IPv6 in brackets)."""
    ns, name = view.namespace, view.name
    hosts = [name, f"{name}.{ns}", f"{name}.{ns}.svc", *view.names]
    hosts += [f"[{ip}]" if ":" in ip else ip for ip in view.cluster_ips]
    return list(dict.fromkeys(hosts))


def http_inspector_listener_filter(detect_ports: Iterable[int]
                                   ) -> listener_components_pb2.ListenerFilter | None:
    """http_inspector enabled only for destination ports that need detection.

    Place after original_dst (the predicate reads the restored destination). Other ports
    never wait on it, so server-first protocols there are not delayed.
    """
    ports = sorted(set(detect_ports))
    if not ports:
        return None
    lf = listener_components_pb2.ListenerFilter(name=HTTP_INSPECTOR)
    lf.typed_config.Pack(http_inspector_pb2.HttpInspector())
    Pred = listener_components_pb2.ListenerFilterChainMatchPredicate
    rules = [Pred(destination_port_range=range_pb2.Int32Range(start=p, end=p + 1)) for p in ports]
    enabled = rules[0] if len(rules) == 1 else Pred(or_match=Pred.MatchSet(rules=rules))
    lf.filter_disabled.CopyFrom(Pred(not_match=enabled))
    return lf


#: seconds an upstream HTTP connection of a per-downstream pool may idle
PER_DOWNSTREAM_IDLE_S = 5.0


def upstream_http_protocol_options(app_protocol: str | None
                                   ) -> http_protocol_options_pb2.HttpProtocolOptions:
    """Cluster-side HTTP protocol for a backend port (``typed_extension_protocol_options``
    under ``HTTP_PROTOCOL_OPTIONS_KEY``; tcp_proxy ignores it, so every Service cluster may
    carry it). h2c appProtocols speak HTTP/2 prior knowledge; otherwise mirror the client's
    protocol, so gRPC (h2c downstream) reaches the backend as HTTP/2.

    Every cluster carrying these pools per downstream connection, so once the caller has
    gone its pool's idle upstream connection serves nobody, and Envoy's default keeps it an
    hour: callers opening a connection a request exhausted the node Envoy's descriptors that
    way (20,000, in bench.mesh_mtls's new-connection rounds) and it crashed (SIGSEGV after
    "socket(2) failed: Too many open files"). Idle upstream connections close after
    ``PER_DOWNSTREAM_IDLE_S``."""
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    opts.common_http_protocol_options.idle_timeout.CopyFrom(duration(PER_DOWNSTREAM_IDLE_S))
    if app_protocol is not None and app_protocol.lower() in H2C_APP_PROTOCOLS:
        opts.explicit_http_config.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    else:
        cfg = opts.use_downstream_protocol_config
        cfg.http_protocol_options.CopyFrom(protocol_pb2.Http1ProtocolOptions())
        cfg.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    return opts
