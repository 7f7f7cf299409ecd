"""The running agent: its composition (``app``), the mesh runtime that keeps Envoy current
(``mesh``), and the loops beside them — live enrollment, recovery at start, the debounced
background pass and the agent-to-agent take-over."""
