"""aether-agent: the node agent of the aether service mesh."""

__version__ = "0.1.0"
