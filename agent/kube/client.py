"""The Kubernetes API client factory every part of the agent uses (the watchers, the route
status writer, the node loops, uninstall-on-exit): one way to load the config, one retry
policy.

Two retry policies, by what the caller does. Request/response callers (status writes, the
node taint, the DaemonSet check) get one urllib3 retry, reads included: a pooled keep-alive
connection the API server closed while idle fails the next request once, harmlessly.
Watchers and the tenacity-budgeted source (``streaming=True``) own their retries: urllib3's
silent read retries would multiply every timeout and hide cut streams, so only one connect
retry is left to it.
"""

from __future__ import annotations

from typing import Any

import urllib3
from kubernetes import client, config


def raw_options(timeout: float) -> dict[str, Any]:
    """Per-call options of every agent request: raw JSON answers (``_preload_content=False``:
    no model classes) and one (connect, read) timeout."""
    return {"_preload_content": False, "_request_timeout": (timeout, timeout)}


class KubeConfigError(Exception):
    """No usable config: the kubeconfig file or the in-cluster service account."""


def api_client(kubeconfig: str | None = None, *, context: str | None = None,
               streaming: bool = False) -> client.ApiClient:
    """A client from ``kubeconfig`` (and its ``context``), or the in-cluster service account
    when it is None or empty; ``streaming``: the caller owns read retries (see above)."""
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
    cfg.retries = (urllib3.Retry(total=1, connect=1, read=0, redirect=0, status=0) if streaming
                   else urllib3.Retry(total=1))
    return client.ApiClient(cfg)


def done(resp: Any) -> None:
    """Hand a raw (``_preload_content=False``) answer's connection back to the pool — read
    to its end first. ``release_conn()`` alone pools the connection with the unread body
    still in it, and the next request on that connection reads it as its status line
    (``BadStatusLine('{"apiVersion": …')``): a failed call, or one silent retry spent."""
    try:
        resp.data  # noqa: B018 - reading it is the point (cached once read)
    except Exception:  # noqa: BLE001 - the call succeeded; a body cut short is not its error
        abandon(resp)  # but that connection must not be reused
        return
    resp.release_conn()


def abandon(resp: Any) -> None:
    """Stop reading a stream (a watch) before its end: the connection is closed, never
    pooled with the rest of the stream in it."""
    try:
        resp.close()
    finally:
        resp.release_conn()
