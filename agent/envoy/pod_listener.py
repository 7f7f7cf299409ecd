"""``capture-<container id>``: a captured pod's listener, bound on its netns loopback,
constant-size whatever the Services (see ``agent.envoy.resources``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from envoy.config.listener.v3 import listener_components_pb2, listener_pb2

from agent.authz.policy import Policy
from agent.envoy import mtls
from agent.envoy.golden import SOURCE_STATE
from agent.envoy.names import (
    CAPTURE_LISTENER_STATE,
    DEFAULT_NAMESPACE,
    LISTENER_PREFIX,
    astuple_shallow,
    namespace_listener_name,
)
from agent.envoy.pieces import (
    ORIGINAL_DST_LOCAL_STATE,
    ORIGINAL_DST_REMOTE_STATE,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    UPSTREAM_NETNS_STATE,
    original_dst_filter,
    set_filter_state,
    state_value,
    tcp_proxy_filter,
)
from agent.envoy.service_chains import (
    _socket_address,
)
from agent.identity.svid import identity_key


@dataclass(frozen=True)
class PodListener:
    """A pod whose outbound TCP is redirected to the capture port in its own netns."""

    uid: str
    netns_path: str
    ipv4: bool = True
    ipv6: bool = True
    # The pod's namespace: picks the internal listener (caller-namespace chain table).
    namespace: str = DEFAULT_NAMESPACE
    # Its ServiceAccount (the mesh identity it calls and is called as) and addresses (what
    # its inbound mTLS listener delivers to); used only with ``NodeXdsState.mesh_tls``.
    service_account: str = "default"
    ips: tuple[str, ...] = ()
    # Its workload (the owner, not the pod): the source the golden metrics count it under.
    workload: str = ""
    # The pod's name when the golden metrics label the calling pod (--traffic-source-pods)
    source_pod: str = ""
    # The AuthorizationPolicies that select the pod (agent.authz), enforced on its inbound
    # mTLS listener; a change makes another PodListener, so the diff rebuilds just this pod
    authz: tuple[Policy, ...] = ()

    @property
    def source(self) -> str:
        """``<namespace>/<workload>`` (the listener's uid when the workload is unknown), and
        ``/<pod>`` when the metrics label the calling pod."""
        src = f"{self.namespace or DEFAULT_NAMESPACE}/{self.workload or self.uid}"
        return f"{src}/{self.source_pod}" if self.source_pod else src

    # Every publish walks every pod (build, hashes): what it asks of each is computed once
    # per object (these are frozen), not once per pod per ADD.
    @cached_property
    def identity(self) -> str:
        return identity_key(self.namespace or DEFAULT_NAMESPACE, self.service_account)

    @cached_property
    def listener_name(self) -> str:
        return f"{LISTENER_PREFIX}{self.uid}"

    @cached_property
    def _hash(self) -> int:
        return hash(astuple_shallow(self))

    def __hash__(self) -> int:
        return self._hash

    @property
    def mesh_listener_name(self) -> str:
        """The cluster ``mesh-<ns>`` the pod listener hands its connections to (it reaches
        ``mesh`` or the namespace's own internal listener)."""
        return namespace_listener_name(self.namespace)


def _capture_chain(pod: PodListener, mesh_identity: bool = False
                   ) -> listener_components_pb2.FilterChain:
    """Hand the connection, its original destination/source and the pod listener name to
    the pod namespace's internal listener (filter state shared with the upstream once), and
    the pod's netns path to every hop after it (transitive), so the final upstream socket is
    opened inside the pod's netns (see ``upstream_bind_config``)."""
    state_filter = set_filter_state(
        state_value(ORIGINAL_DST_LOCAL_STATE, "%DOWNSTREAM_LOCAL_ADDRESS%"),
        state_value(ORIGINAL_DST_REMOTE_STATE, "%DOWNSTREAM_REMOTE_ADDRESS%"),
        state_value(CAPTURE_LISTENER_STATE, pod.listener_name, STRING_STATE_FACTORY),
        state_value(SOURCE_STATE, pod.source, STRING_STATE_FACTORY),
        state_value(UPSTREAM_NETNS_STATE, pod.netns_path, STRING_STATE_FACTORY, TRANSITIVE),
        *([mtls.caller_state(pod.identity)] if mesh_identity else []),
    )
    return listener_components_pb2.FilterChain(
        name="capture",
        filters=[state_filter, tcp_proxy_filter("capture", pod.mesh_listener_name)],
    )


def build_listener(pod: PodListener, capture_port: int, mesh_identity: bool = False
                   ) -> listener_pb2.Listener:
    """The pod's capture listener on the loopbacks of its netns (v4 and/or v6): constant
    size, independent of the Services (they live in the namespace's internal listener).
    ``mesh_identity``: the pod's SVID is held, its mesh connections carry its identity."""
    ips = (["127.0.0.1"] if pod.ipv4 else []) + (["::1"] if pod.ipv6 else [])
    if not ips:
        raise ValueError(f"pod {pod.uid}: at least one of ipv4/ipv6 must be enabled")
    addrs = [_socket_address(ip, capture_port, pod.netns_path) for ip in ips]
    listener = listener_pb2.Listener(
        name=pod.listener_name,
        stat_prefix=pod.listener_name,
        address=addrs[0],
        listener_filters=[original_dst_filter()],
        default_filter_chain=_capture_chain(pod, mesh_identity),
    )
    for a in addrs[1:]:
        listener.additional_addresses.add().address.CopyFrom(a)
    listener.bind_to_port.value = True
    return listener
