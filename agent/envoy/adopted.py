"""What an adopted Envoy already holds, read from its admin's config dump (pure parsing).

A restarted agent adopts the Envoy its predecessor left serving. Its resource builder
starts empty, so without this its first push could point a namespace's cluster at an
internal listener Envoy does not have yet (pushes go CDS before LDS: the namespace's new
connections fail until the LDS lands), and could drop a namespace's own internal listener
its predecessor was keeping for the connections that cross it. The builder is seeded with
what Envoy has instead (``ResourceBuilder.seed``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.envoy.resources import NAMESPACE_LISTENER_PREFIX, SHARED_MESH_LISTENER

#: the admin's ``name_regex`` must match a resource's whole name (a prefix alone matches none)
CLUSTERS_REGEX = f"^{NAMESPACE_LISTENER_PREFIX}.*$"
LISTENERS_REGEX = f"^({SHARED_MESH_LISTENER}|{NAMESPACE_LISTENER_PREFIX}.*)$"
#: the admin paths that ask for just the namespace clusters and the mesh internal listeners
CLUSTERS_PATH = f"/config_dump?resource=dynamic_active_clusters&name_regex={CLUSTERS_REGEX}"
LISTENERS_PATH = f"/config_dump?resource=dynamic_listeners&name_regex={LISTENERS_REGEX}"


def namespace_reach(dump: Mapping[str, Any]) -> dict[str, str]:
    """Caller namespace -> the internal listener its ``mesh-<ns>`` cluster reaches, from a
    ``dynamic_active_clusters`` dump. Clusters of another shape are skipped."""
    out: dict[str, str] = {}
    for item in dump.get("configs") or []:
        cluster = item.get("cluster") or {}
        name = str(cluster.get("name") or "")
        if not name.startswith(NAMESPACE_LISTENER_PREFIX):
            continue
        targets = {str(((ep.get("endpoint") or {}).get("address") or {})
                       .get("envoy_internal_address", {}).get("server_listener_name") or "")
                   for group in (cluster.get("load_assignment") or {}).get("endpoints") or []
                   for ep in group.get("lb_endpoints") or []}
        if len(targets) == 1 and (target := targets.pop()):
            out[name.removeprefix(NAMESPACE_LISTENER_PREFIX)] = target
    return out


def listener_names(dump: Mapping[str, Any]) -> list[str]:
    """Names of the listeners a ``dynamic_listeners`` dump shows active (warming ones are
    not serving yet)."""
    return sorted(str(item.get("name")) for item in dump.get("configs") or []
                  if item.get("name") and "active_state" in item)
