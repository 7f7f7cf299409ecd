"""The Kubernetes API client factory every part of the agent uses (the watchers, the route
status writer, the node loops, uninstall-on-exit): one way to load the config, one retry
policy.

The callers own their retries (tenacity budgets, watch backoff); urllib3's default of three
silent read retries would multiply every timeout by four and hide cut connections, so only
one connect retry is left to it (cheap, and it covers a just-restarted API server).
"""

from __future__ import annotations

import urllib3
from kubernetes import client, config


class KubeConfigError(Exception):
    """No usable config: the kubeconfig file or the in-cluster service account."""


def api_client(kubeconfig: str | None = None, *, context: str | None = None) -> client.ApiClient:
    """A client from ``kubeconfig`` (and its ``context``), or the in-cluster service account
    when it is None or empty."""
    cfg = client.Configuration()
    try:
        if not kubeconfig:
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=kubeconfig, context=context,
                                    client_configuration=cfg)
    except Exception as exc:  # ConfigException, OSError, YAML errors: all mean "no config"
        where = kubeconfig or "in-cluster service account"
        raise KubeConfigError(f"cannot load Kubernetes config from {where}: {exc}") from exc
    cfg.retries = urllib3.Retry(total=1, connect=1, read=0, redirect=0, status=0)
    return client.ApiClient(cfg)
