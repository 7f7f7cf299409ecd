"""Small pieces every layer stands on: node-wide defaults (``config``), typed identifiers,
structured logs, limits, back-off, the connection cap of the threaded servers, the GC
settings and a pod's workload name. Nothing here imports another agent package."""
