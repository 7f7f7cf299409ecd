"""GAMMA route status, mesh ownership, leader election and the XMesh publication.

Pure parts (``ownership``, ``conditions``) decide; ``status``, ``lease`` and ``xmesh`` talk
to the API. The route-table builder (``agent.scope.route_tables``) is independent: both meet at the
small ``ParentStatus`` record defined in ``conditions``.
"""

DEFAULT_CONTROLLER_NAME = "aether.io/mesh"
