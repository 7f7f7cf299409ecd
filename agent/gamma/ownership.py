"""Explicit mesh ownership (docs/ownership.md): which GAMMA routes aether acts on.

Gateway API has no field saying which mesh implements a route whose parent is a Service
(gateway-api issue "Specify Explicit Controller when HTTPRoute backend is a Service"), so two
meshes in one cluster both program and both write status for the same route. aether acts
only when the parent Service belongs to the aether mesh, and steps back whenever an
annotation names another controller. Pure: the caller passes the objects it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: On a route: comma-separated controllerNames allowed to implement it (absent: any mesh
#: that owns the parent Service). On a Service or Namespace: the one controllerName that owns
#: it as a GAMMA parent. Our own domain: ``*.k8s.io`` keys are reserved for upstream.
MESH_CONTROLLER_ANNOTATION = "aether.io/mesh-controller"
#: Label on a Namespace (enrol every Service in it) or a Service ("true"/"false").
MANAGED_LABEL = "aether.io/managed"

Obj = Mapping[str, Any]


def _meta(obj: Obj | None, field: str) -> Mapping[str, str]:
    if not obj:
        return {}
    value = (obj.get("metadata") or {}).get(field) or {}
    return value if isinstance(value, Mapping) else {}


def controllers(value: str | None) -> list[str]:
    """``"a.io/x, b.io/y"`` → ``["a.io/x", "b.io/y"]`` (blank entries dropped)."""
    return [c.strip() for c in (value or "").split(",") if c.strip()]


def route_allows(route_obj: Obj | None, controller_name: str) -> tuple[bool, str]:
    """Does the route's own annotation let ``controller_name`` implement it?"""
    named = controllers(_meta(route_obj, "annotations").get(MESH_CONTROLLER_ANNOTATION))
    if not named:
        return True, "route names no mesh controller"
    if controller_name in named:
        return True, f"route annotation {MESH_CONTROLLER_ANNOTATION} names {controller_name}"
    return False, f"route annotation {MESH_CONTROLLER_ANNOTATION} names {', '.join(named)}"


def membership(
    service_obj: Obj | None, namespace_obj: Obj | None, controller_name: str
) -> tuple[bool, str]:
    """Is the Service (possibly missing) a member of this mesh? First decisive rule wins."""
    what = "Service"
    for obj in (service_obj, namespace_obj):
        owner = _meta(obj, "annotations").get(MESH_CONTROLLER_ANNOTATION, "").strip()
        if owner:
            if owner == controller_name:
                return True, f"{what} annotation {MESH_CONTROLLER_ANNOTATION}={owner}"
            return False, f"{what} annotation {MESH_CONTROLLER_ANNOTATION}={owner}"
        what = "Namespace"
    label = _meta(service_obj, "labels").get(MANAGED_LABEL)
    if label == "true":
        return True, f"Service label {MANAGED_LABEL}=true"
    if label == "false":
        return False, f"Service label {MANAGED_LABEL}=false"
    if _meta(namespace_obj, "labels").get(MANAGED_LABEL) == "true":
        return True, f"Namespace label {MANAGED_LABEL}=true"
    return False, f"neither the Service nor its Namespace is labelled {MANAGED_LABEL}=true"


def owns(
    route_obj: Obj | None,
    parent_service_obj: Obj | None,
    namespace_obj: Obj | None,
    controller_name: str,
) -> tuple[bool, str]:
    """Do we act on (route, this Service parent): program it and write its status?

    ``namespace_obj`` is the parent Service's Namespace. A missing Service still belongs to
    us when its Namespace is enrolled: the route then gets ``Accepted=False NoMatchingParent``
    from us rather than silence.
    """
    allowed, why = route_allows(route_obj, controller_name)
    if not allowed:
        return False, why
    return membership(parent_service_obj, namespace_obj, controller_name)
