"""Pure construction of the Envoy bootstrap (JSON-able dict) plus a tiny writer.

The bootstrap holds only what must exist before xDS is reachable: the node identity,
the ``xds`` cluster over the agent's unix socket, the admin endpoint, the overload
manager and the internal listener extension (``mesh`` and any ``mesh-<ns>``, the
listeners that pod capture listeners hand their connections to, are Envoy internal
listeners).
Everything per-pod arrives over ADS.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from agent.envoy.compat import BUILT_FOR, EnvoyVersion, bootstrap_runtime
from agent.envoy.golden import bootstrap_stats_config

XDS_CLUSTER = "xds"
NODE_CLUSTER = "aether"
ADMIN_SOCKET_MODE = 0o600  # Envoy's admin can drain every pod's listener: root only
DEFAULT_MAX_DOWNSTREAM_CONNECTIONS = 50000
HTTP2_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
INTERNAL_LISTENER_EXTENSION = "envoy.bootstrap.internal_listener"
INTERNAL_LISTENER_TYPE = (
    "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
)
DOWNSTREAM_CONN_MONITOR_TYPE = (
    "type.googleapis.com/envoy.extensions.resource_monitors."
    "downstream_connections.v3.DownstreamConnectionsConfig"
)


def _admin_address(admin: str | int, mode: int = ADMIN_SOCKET_MODE) -> dict[str, Any]:
    """An int (or digit string) is a loopback TCP port (any local user can reach it); anything
    else a unix socket path, created by Envoy with ``mode`` (``Pipe.mode``: Envoy unlinks,
    binds, then chmods, so the directory holding it must keep others out too)."""
    if isinstance(admin, int) or str(admin).isdigit():
        return {"socket_address": {"address": "127.0.0.1", "port_value": int(admin)}}
    return {"pipe": {"path": str(admin), "mode": mode}}


def proto_to_json(msg: Message) -> dict[str, Any]:
    """Proto -> bootstrap JSON with the ``@type`` of Any fields kept."""
    out: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)
    return out


def build_bootstrap(
    node_id: str,
    xds_socket: str,
    admin: str | int,
    *,
    admin_mode: int = ADMIN_SOCKET_MODE,
    delta: bool = True,
    set_node_on_first_message_only: bool = True,
    max_downstream_connections: int = DEFAULT_MAX_DOWNSTREAM_CONNECTIONS,
    xds_connect_timeout_s: float = 1.0,
    initial_fetch_timeout_s: float | None = 0.0,
    static_listeners: Iterable[Message] = (),
    static_clusters: Iterable[Message] = (),
    dynamic: bool = True,
    envoy_version: EnvoyVersion = BUILT_FOR,
) -> dict[str, Any]:
    """Bootstrap that points LDS and CDS at ADS served on ``xds_socket`` (unix socket), with
    the admin on ``admin``: a unix socket path (``admin_mode``, default 0600) or a TCP port
    on 127.0.0.1.

    ``initial_fetch_timeout_s=0`` means Envoy waits for xDS before reporting ready, so
    ``/ready`` only turns LIVE once the first config has landed. ``static_*`` embed
    pre-built resources (used to validate them with ``envoy --mode validate``).
    """
    xds_cluster: dict[str, Any] = {
        "name": XDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": f"{xds_connect_timeout_s}s",
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": xds_socket}}}}]}
            ],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP2_OPTIONS_TYPE,
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                    }
                },
            }
        },
    }
    boot: dict[str, Any] = {
        "node": {"id": node_id, "cluster": NODE_CLUSTER},
        "admin": {"address": _admin_address(admin, admin_mode)},
        "static_resources": {
            "clusters": [xds_cluster] + [proto_to_json(c) for c in static_clusters],
        },
        # user-space internal listeners (envoy_internal_address): mesh, mesh-<ns>
        "bootstrap_extensions": [{
            "name": INTERNAL_LISTENER_EXTENSION,
            "typed_config": {"@type": INTERNAL_LISTENER_TYPE},
        }],
        # the golden metrics' request-duration buckets (agent.envoy.golden)
        "stats_config": bootstrap_stats_config(),
        # A cluster's traffic stats (upstream_cx_*, upstream_rq_*: 66 of its 107) are made
        # on its first connection, not when it is added: most of a node's 10k Service
        # clusters never carry one. A bare Envoy adding 10k clusters: 2.8 -> 1.6 s and
        # 527 -> 335 MB RSS (measured here). Readers see a missing stat as zero.
        "deferred_stat_options": {"enable_deferred_creation_stats": True},
        # the runtime guards this Envoy knows (agent.envoy.compat)
        "layered_runtime": {"layers": [{"name": "static",
                                        "static_layer": bootstrap_runtime(envoy_version)}]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": DOWNSTREAM_CONN_MONITOR_TYPE,
                        "max_active_downstream_connections": max_downstream_connections,
                    },
                }
            ]
        },
    }
    listeners = [proto_to_json(lis) for lis in static_listeners]
    if listeners:
        boot["static_resources"]["listeners"] = listeners
    if dynamic:
        ads_source: dict[str, Any] = {"ads": {}, "resource_api_version": "V3"}
        if initial_fetch_timeout_s is not None:
            ads_source["initial_fetch_timeout"] = f"{initial_fetch_timeout_s}s"
        boot["dynamic_resources"] = {
            "ads_config": {
                "api_type": "DELTA_GRPC" if delta else "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": set_node_on_first_message_only,
                "grpc_services": [{"envoy_grpc": {
                    "cluster_name": XDS_CLUSTER,
                    # reconnect fast after an agent restart: ADD waits on the ACK
                    "retry_policy": {"retry_back_off": {"base_interval": "0.1s",
                                                        "max_interval": "1s"}},
                }}],
            },
            "lds_config": dict(ads_source),
            "cds_config": dict(ads_source),
        }
    return boot


def ensure_private_dir(path: str) -> None:
    """``path`` exists as a directory of ours that only we can enter (0700), or this raises.

    It holds Envoy's admin socket: Envoy binds the socket before it chmods it, and whoever can
    reach the admin can stop every pod's listener, so the directory is the real gate."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} must be a directory owned by uid {os.geteuid()} "
                              f"(it holds Envoy's admin socket)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def write_bootstrap(path: str, bootstrap: Mapping[str, Any]) -> None:
    """Atomic write (tmp + rename) so a restarting Envoy never reads a half file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".bootstrap-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(bootstrap, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
