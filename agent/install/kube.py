"""Is our DaemonSet still there? Decides whether exiting means 'upgrade' or 'removal'.

During an upgrade (DaemonSet present, not being deleted) the entry must stay: new pods then
wait for the new agent (the shim fails closed) instead of starting uncaptured.
"""

from __future__ import annotations

import json
import logging
from enum import Enum
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.kube import api_client

log = logging.getLogger("aether.install")


class DaemonSetState(Enum):
    PRESENT = "present"  # upgrade / restart: keep the entry
    DELETING = "deleting"  # deletionTimestamp set: we are being removed
    ABSENT = "absent"
    UNKNOWN = "unknown"  # API unreachable: keep the entry (fail closed)


def daemonset_state(kubeconfig: str | None, namespace: str, name: str,
                    timeout: float = 5.0) -> DaemonSetState:
    """GET apps/v1 daemonsets/<ns>/<name>, mapped to what uninstall-on-exit should do."""
    try:
        api = api_client(kubeconfig or None)
    except Exception as e:  # noqa: BLE001 - no config at all: cannot tell
        log.warning("cannot load Kubernetes config (%s): assuming an upgrade", e)
        return DaemonSetState.UNKNOWN
    try:
        resp: Any = client.AppsV1Api(api).read_namespaced_daemon_set(  # raw urllib3 response
            name, namespace, _preload_content=False, _request_timeout=(timeout, timeout))
        obj = json.loads(resp.data)
    except ApiException as e:
        if e.status == 404:
            return DaemonSetState.ABSENT
        log.warning("DaemonSet %s/%s: HTTP %s: assuming an upgrade", namespace, name, e.status)
        return DaemonSetState.UNKNOWN
    except Exception as e:  # noqa: BLE001 - network errors of every kind
        log.warning("DaemonSet %s/%s unreadable (%s): assuming an upgrade", namespace, name, e)
        return DaemonSetState.UNKNOWN
    finally:
        api.close()
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return DaemonSetState.DELETING
    return DaemonSetState.PRESENT
