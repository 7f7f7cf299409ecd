"""Plain metadata records that every source (Kubernetes API, manifest directory) produces.

Sources hand out raw Kubernetes JSON objects (dicts); these helpers turn them into the few
fields the capture decision needs, so the decision stays a pure function of plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PodMeta:
    namespace: str
    name: str
    uid: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account: str = "default"
    node_name: str = ""
    host_network: bool = False
    net_admin: bool = False  # a container can set SO_MARK: it could forge the passthrough mark
    ips: tuple[str, ...] = ()  # status.podIPs: how a pod older than the agent is found
    phase: str = ""  # status.phase

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class NamespaceMeta:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): "" if v is None else str(v) for k, v in value.items()}


def pod_from_object(obj: dict[str, Any]) -> PodMeta:
    """Kubernetes Pod JSON → PodMeta (missing fields take Kubernetes' defaults)."""
    meta = _map(obj.get("metadata"))
    spec = _map(obj.get("spec"))
    status = _map(obj.get("status"))
    ips = [str(_map(x).get("ip") or "") for x in _list(status.get("podIPs"))]
    if not ips and status.get("podIP"):
        ips = [str(status["podIP"])]
    return PodMeta(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
        service_account=str(
            spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        ),
        node_name=str(spec.get("nodeName") or ""),
        host_network=bool(spec.get("hostNetwork") or False),
        net_admin=_holds_net_admin(spec),
        ips=tuple(ip for ip in ips if ip),
        phase=str(status.get("phase") or ""),
    )


def _map(value: Any) -> dict[str, Any]:
    """A field that should be a mapping; anything else (a hand-written manifest can hold a
    list or a number anywhere) reads as empty rather than failing the lookup."""
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _holds_net_admin(spec: dict[str, Any]) -> bool:
    for c in _list(spec.get("containers")) + _list(spec.get("initContainers")):
        if not isinstance(c, dict):
            continue
        sc = _map(c.get("securityContext"))
        if sc.get("privileged"):
            return True
        caps = _list(_map(sc.get("capabilities")).get("add"))
        if any(str(x).upper() in ("NET_ADMIN", "CAP_NET_ADMIN", "ALL") for x in caps):
            return True
    return False


def namespace_from_object(obj: dict[str, Any]) -> NamespaceMeta:
    meta = _map(obj.get("metadata"))
    return NamespaceMeta(
        name=str(meta.get("name") or ""),
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
    )
