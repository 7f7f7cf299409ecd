"""``judge-<uid>``: the plaintext inbound of a pod that an AuthorizationPolicy selects (#41).

A PERMISSIVE pod accepts plaintext: a caller outside the mesh (an uncaptured pod, a node
process) dials its address directly and no mTLS listener sees it. Once a policy selects the
pod, its rules steer new inbound connections here (``agent.capture.rules``, the same
exemptions as STRICT: loopback, the mesh hop's port, the node's addresses), where the
policies are applied as to a caller with no identity (only ``ipBlocks`` can match it; the
port is the restored destination port) and what they allow is delivered to the pod's own
address and port, in its netns, as the mesh hop delivers. A denied connection is closed
before a byte is relayed.
"""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import address_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2

from agent.authz.policy import Policy
from agent.authz.rbac import NETWORK_RBAC, PLAINTEXT, network_rbac_filters
from agent.envoy.mtls import (
    DESTINATION_STATE,
    INBOUND_DELIVER_CLUSTER,
    ORIGINAL_DST_ADDRESS_STATE,
    deliver_target,
    pod_detect_name,
)
from agent.envoy.pieces import (
    ONCE,
    ORIGINAL_DST_LOCAL_STATE,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    UPSTREAM_NETNS_STATE,
    original_dst_filter,
    set_filter_state,
    state_value,
    stdout_access_log,
    tcp_proxy_filter,
)

JUDGE_LISTENER_PREFIX = "judge-"
JUDGE_LOG_FORMAT = (
    "[%START_TIME%] judged plaintext from=%DOWNSTREAM_REMOTE_ADDRESS% -> "
    "%DOWNSTREAM_LOCAL_ADDRESS% pod=%UPSTREAM_HOST% flags=%RESPONSE_FLAGS% "
    "why=%CONNECTION_TERMINATION_DETAILS% rx=%BYTES_RECEIVED% tx=%BYTES_SENT% "
    "dur=%DURATION%ms\n")


def judge_listener_name(uid: str) -> str:
    return f"{JUDGE_LISTENER_PREFIX}{uid}"


def build_judge_listener(uid: str, netns_path: str, ips: Sequence[str],
                         policies: Sequence[Policy], port: int, ipv4: bool = True,
                         ipv6: bool = True, access_log: bool = False, detect: bool = False,
                         workload: str = "") -> listener_pb2.Listener:
    """The pod's judging listener on ``port`` of every family it has, in its netns;
    ``access_log``: a stdout line per connection, a denial's reason included. ``detect``:
    the pod has its own detection listener (its policies name HTTP fields), where these
    connections are decided too, after detection (an HTTP denial is then a 403); its
    requests are counted under ``workload`` (``<ns>/<workload>``) as a caller's with no
    identity."""
    if not ips:
        raise ValueError(f"pod {uid}: no address to deliver to")
    addrs = ([("0.0.0.0", port)] if ipv4 else []) + ([("::", port)] if ipv6 else [])
    if not addrs:
        raise ValueError(f"pod {uid}: at least one of ipv4/ipv6 must be enabled")
    name = judge_listener_name(uid)
    to = f"{deliver_target(ips)}:%DOWNSTREAM_LOCAL_PORT%"
    shared = TRANSITIVE if detect else ONCE  # past the detection listener, to the pod
    values = [state_value(ORIGINAL_DST_ADDRESS_STATE, to, shared=shared),
              state_value(UPSTREAM_NETNS_STATE, netns_path, STRING_STATE_FACTORY, shared)]
    if detect:
        values += [state_value(DESTINATION_STATE, f"{workload or uid}|%DOWNSTREAM_LOCAL_PORT%",
                               STRING_STATE_FACTORY, TRANSITIVE),
                   state_value(ORIGINAL_DST_LOCAL_STATE, to)]
    state = set_filter_state(*values)
    rbac = []
    for cfg in ([] if detect else network_rbac_filters(policies, PLAINTEXT, scope=uid)):
        f = listener_components_pb2.Filter(name=NETWORK_RBAC)
        f.typed_config.Pack(cfg)
        rbac.append(f)

    def sock(ip: str, p: int) -> address_pb2.Address:
        return address_pb2.Address(socket_address=address_pb2.SocketAddress(
            address=ip, port_value=p, network_namespace_filepath=netns_path))

    lis = listener_pb2.Listener(
        name=name, stat_prefix=name, address=sock(*addrs[0]),
        listener_filters=[original_dst_filter()],
        filter_chains=[listener_components_pb2.FilterChain(
            name="judged", filters=[state, *rbac, tcp_proxy_filter(
                name, pod_detect_name(uid) if detect else INBOUND_DELIVER_CLUSTER,
                *([stdout_access_log(JUDGE_LOG_FORMAT)] if access_log else []))])])
    for a in addrs[1:]:
        lis.additional_addresses.add().address.CopyFrom(sock(*a))
    if ipv4 and ipv6:
        lis.address.socket_address.ipv4_compat = False
    return lis
