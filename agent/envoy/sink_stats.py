"""What the node Envoy's stats say of the traffic, read through its admin for the sink:
the golden metrics, passthrough and connection figures, AuthorizationPolicy decisions.

Split from ``agent.envoy.sink`` (a mixin of ``EnvoySink``, whose ``__init__`` sets the
state declared here): reading Envoy's counters, apart from configuring Envoy.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from agent.envoy.golden import GoldenFold
from agent.envoy.resources import PodListener


class EnvoyStats:
    """``EnvoySink``'s reads of Envoy's stats, cached for a second."""

    # set by EnvoySink.__init__
    admin: str
    golden_fold: GoldenFold
    _lock: threading.Lock
    _pods: dict[str, PodListener]
    _services: tuple[Any, ...]
    _envoy_traffic: tuple[float, dict[str, Any]] | None
    _envoy_traffic_lock: threading.Lock

    def envoy_traffic(self) -> dict[str, Any]:
        """What Envoy's stats hold of the traffic, read from its admin and reused for a
        second (a scrape and a ``top`` sample in the same second ask Envoy once):
        ``golden``, the golden metrics (``agent.envoy.golden``, capped), and ``envoy``,
        passthrough by destination class and open connections per Service
        (``agent.envoy.envoy_stats``). Raises OSError or ValueError when the admin does
        not answer."""
        import json
        import urllib.parse

        from agent.envoy import envoy_stats, golden
        from agent.envoy.supervisor import admin_request
        with self._envoy_traffic_lock:
            cached = self._envoy_traffic
            if cached is not None and time.monotonic() - cached[0] < 1.0:
                return cached[1]
            path = "/stats?format=json&filter=" + urllib.parse.quote(envoy_stats.STATS_FILTER)
            code, body = admin_request(self.admin, "GET", path, timeout=1.0)
            if code != 200:
                raise ValueError(f"envoy admin answered {code} for its stats")
            served = [f"{v.namespace}/{v.name}" for v in self._services]
            figures: dict[str, Any] = {"envoy": envoy_stats.parse(json.loads(body), served)}
            path = "/stats/prometheus?filter=" + urllib.parse.quote(golden.STATS_FILTER)
            code, text = admin_request(self.admin, "GET", path, timeout=2.0)
            if code != 200:
                raise ValueError(f"envoy admin answered {code} for its golden stats")
            series = golden.parse_prometheus(text)
            resolve = None
            if series.inbound:
                with self._lock:
                    pods, views = tuple(self._pods.values()), self._services
                resolve = golden.service_resolver(views, pods)
            figures["golden"] = self.golden_fold.snapshot(series, resolve)
            figures["authz"] = self._authz_decisions()
            self._envoy_traffic = (time.monotonic(), figures)
            return figures

    def golden_traffic(self) -> dict[str, Any]:
        """The golden metrics snapshot (``/metrics``, ``aether-agent top``)."""
        golden: dict[str, Any] = self.envoy_traffic()["golden"]
        return golden

    def envoy_figures(self) -> dict[str, Any]:
        """Passthrough by destination class, open connections per Service and the
        AuthorizationPolicy decisions (``authz``)."""
        traffic = self.envoy_traffic()
        return {**traffic["envoy"], "authz": traffic.get("authz") or {}}

    def _authz_decisions(self) -> dict[Any, int]:
        """``agent.authz.stats.decisions`` over Envoy's RBAC counters (empty when no policy
        selects a pod here: nothing asked of Envoy)."""
        import json
        import urllib.parse

        from agent.authz import stats
        from agent.envoy.supervisor import admin_request
        with self._lock:
            pods = {lis.uid: (lis.namespace, lis.workload or lis.uid, lis.authz)
                    for lis in self._pods.values() if lis.authz}
        if not pods:
            return {}
        path = "/stats?format=json&filter=" + urllib.parse.quote(stats.STATS_FILTER)
        code, body = admin_request(self.admin, "GET", path, timeout=1.0)
        if code != 200:
            raise ValueError(f"envoy admin answered {code} for its RBAC stats")
        doc = json.loads(body)
        return stats.decisions(((str(s.get("name")), int(s.get("value") or 0))
                                for s in doc.get("stats") or [] if "value" in s), pods)
