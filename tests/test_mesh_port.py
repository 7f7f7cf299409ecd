"""The single mesh port (proposal 022, #42): ClusterIP:18081 is the Service's HTTP port (the
one named ``http``, else its only port), so ``<svc>.<ns>.<meshDomain>:18081`` reaches it
through the mesh, beside the Service's real ports, in scoped capture and redirect-all alike."""

from __future__ import annotations

from typing import Any

from agent.envoy.resources import LISTENER_TYPE, NodeXdsState, PodListener, ResourceBuilder
from agent.envoy.service_tables import mesh_http_port
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort


def _view(name: str, ip: str, ports: tuple[ServicePort, ...]) -> ServiceView:
    return ServiceView(key=f"mesh/{name}", namespace="mesh", name=name, cluster_ips=(ip,),
                       ports=ports, names=(f"{name}.mesh.svc.cluster.local",),
                       endpoints={p.port: (Endpoint("10.1.0.5", p.target_port or p.port,
                                                    "mesh/web", True, False, "", "mesh/w"),)
                                  for p in ports})


def _chains(views: list[ServiceView]) -> dict[str, Any]:
    built = ResourceBuilder().build(NodeXdsState(pods=(PodListener("p", "/n"),),
                                                 services=tuple(views), mesh_port=18081))
    out = {}
    for listener in built[LISTENER_TYPE].values():
        for c in listener.filter_chains:
            out[c.name] = c
    return out


def test_the_http_port_is_also_served_on_the_mesh_port() -> None:
    web = _view("web", "10.96.5.1", (ServicePort(80, "http", target_port=8080),
                                      ServicePort(9090, "metrics", target_port=9090)))
    chains = _chains([web])
    alias = chains["svc|mesh|web|80|mesh-port"]
    real = chains["svc|mesh|web|80"]
    assert alias.filter_chain_match.destination_port.value == 18081
    assert [r.address_prefix for r in alias.filter_chain_match.prefix_ranges] == ["10.96.5.1"]
    # the same filters (cluster, routes, identity) as the real port's chain
    assert alias.filters == real.filters
    assert "svc|mesh|web|9090|mesh-port" not in chains


def test_which_port_the_mesh_port_stands_for() -> None:
    assert mesh_http_port([ServicePort(8443, "https"), ServicePort(80, "http")]).port == 80  # type: ignore[union-attr]
    assert mesh_http_port([ServicePort(5432, "pg")]).port == 5432  # type: ignore[union-attr]
    assert mesh_http_port([ServicePort(1, "a"), ServicePort(2, "b")]) is None
    # two unnamed-http ports: no alias; a real port 18081 wins over the alias
    chains = _chains([_view("two", "10.96.5.2", (ServicePort(1, "a"), ServicePort(2, "b"))),
                      _view("own", "10.96.5.3", (ServicePort(18081, "http"),))])
    assert not [n for n in chains if n.endswith("|mesh-port")]
    assert chains["svc|mesh|own|18081"].filter_chain_match.destination_port.value == 18081
