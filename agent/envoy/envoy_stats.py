"""The traffic figures that Envoy's own stats already hold, read from its admin at scrape time
instead of an access-log entry per connection (which costs as much as proxying it):

* passthrough connections by destination class: ``mesh`` (a ClusterIP of an in-mesh Service
  this node's scope does not hold yet: the learn chains) and ``outside`` (everything else:
  addresses outside the mesh, whether in the cluster or not);
* per destination Service (``cluster.svc|<ns>|<name>|<port>``, its ports and a headless
  Service's per-pod clusters summed): upstream connections open now, and bytes sent to it
  and received from it.

Pure: the admin's ``/stats?format=json`` document in, plain data out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# tcp_proxy stat prefixes of the passthrough chains (agent.envoy.resources)
PASSTHROUGH_STATS = {"mesh": "passthrough_mesh", "outside": "passthrough_outside"}
CLASSES = tuple(PASSTHROUGH_STATS)

# the admin's ``/stats?format=json&filter=`` regex (the sink quotes it)
STATS_FILTER = (r"^(tcp\.passthrough_(mesh|outside)\.downstream_cx_(total|active)"
                r"|cluster\.(svc|pod)\|.*\.upstream_cx_(active|tx_bytes_total|rx_bytes_total))$")


def empty() -> dict[str, Any]:
    return {"passthrough": {c: {"total": 0, "active": 0} for c in CLASSES}, "active": {},
            "bytes": {}}


def parse(doc: Mapping[str, Any], services: Iterable[str] = ()) -> dict[str, Any]:
    """``{"passthrough": {class: {"total", "active"}}, "active": {"<ns>/<svc>": n},
    "bytes": {"<ns>/<svc>": [sent to it, received from it]}}``. Every Service in
    ``services`` (``<ns>/<name>``: those Envoy holds a cluster for) is there, at zero until
    its cluster carries a connection: Envoy creates a cluster's traffic stats on first use
    (``deferred_stat_options``), and a counter should exist from the start."""
    out = empty()
    for svc in services:
        out["active"][svc] = 0
        out["bytes"][svc] = [0, 0]
    by_prefix = {v: k for k, v in PASSTHROUGH_STATS.items()}
    for s in doc.get("stats") or []:
        if not isinstance(s, Mapping) or "value" not in s:
            continue
        name = str(s.get("name") or "")
        try:
            value = int(s["value"])
        except (TypeError, ValueError):
            continue
        if name.startswith("tcp."):
            _tcp, prefix, stat = name.split(".", 2)
            cls = by_prefix.get(prefix)
            if cls is not None:
                key = "total" if stat == "downstream_cx_total" else "active"
                out["passthrough"][cls][key] += value
        elif name.startswith("cluster."):
            cluster, _, stat = name[len("cluster."):].rpartition(".")
            parts = cluster.split("|")
            if len(parts) < 4:
                continue
            svc = f"{parts[1]}/{parts[2]}"
            if stat == "upstream_cx_active":
                out["active"][svc] = out["active"].get(svc, 0) + value
            elif stat in ("upstream_cx_tx_bytes_total", "upstream_cx_rx_bytes_total"):
                sent_received = out["bytes"].setdefault(svc, [0, 0])
                sent_received[0 if stat == "upstream_cx_tx_bytes_total" else 1] += value
    return out
