"""What a CNI request is for, before anything is touched: the pod and namespace its
K8S_POD_* args name, read from the metadata source (unknown is try-again, never "not
managed"), and the netconf's capture_redirect_all_default. The ADD, CHECK and live
enrollment of the capture lifecycle (agent.cni.lifecycle) all decide on these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from agent.capture.policy import parse_bool
from agent.cni import codes as p
from agent.cni.messages import CniFailure
from agent.common.config import NodeConfig
from agent.source.base import MetadataSource, SourceError
from agent.source.model import NamespaceMeta, PodMeta


def redirect_all_default(netconf: Mapping[str, Any]) -> bool:
    value = netconf.get("capture_redirect_all_default", False)
    if isinstance(value, bool):
        return value
    return bool(parse_bool(str(value)))


def lookup_pod(node: NodeConfig, source: MetadataSource,
               args: Mapping[str, str]) -> tuple[PodMeta, NamespaceMeta | None] | None:
    """The pod and its namespace; None when the request is not for a pod.

    Unknown is not "no": a pod or namespace the source cannot answer for (not seen yet,
    a manifest mid-rewrite or unparsable, an API 404 from a lagging cache) is CNI
    try-again, never "not managed". Only system namespaces are decided by name alone.
    """
    ns_name = args.get("K8S_POD_NAMESPACE", "")
    pod_name = args.get("K8S_POD_NAME", "")
    if not ns_name or not pod_name:
        return None
    uid = args.get("K8S_POD_UID", "")
    if ns_name in node.system_namespaces:  # never captured, whatever the source says
        return PodMeta(namespace=ns_name, name=pod_name, uid=uid), None
    where = source.describe()
    try:
        pod = source.get_pod(ns_name, pod_name, uid)
        namespace = source.get_namespace(ns_name)
    except SourceError as e:
        raise CniFailure(
            p.ERR_TRY_AGAIN,
            f"cannot read pod {ns_name}/{pod_name} from {where}: "
            "the pod cannot be captured now",
            str(e),
        ) from e
    if pod is None:
        raise CniFailure(
            p.ERR_TRY_AGAIN,
            f"pod {ns_name}/{pod_name} is not known to {where} (yet): the agent cannot "
            "tell whether it is to be captured; try again",
            source_problems(source),
        )
    if namespace is None:
        raise CniFailure(
            p.ERR_TRY_AGAIN,
            f"namespace {ns_name} of pod {ns_name}/{pod_name} is not known to {where} "
            "(yet): the agent cannot tell whether the pod is to be captured; try again",
            source_problems(source),
        )
    if uid and pod.uid and pod.uid != uid:
        raise CniFailure(
            p.ERR_TRY_AGAIN,
            f"{where} knows pod {ns_name}/{pod_name} as uid {pod.uid}, kubelet starts uid "
            f"{uid}: not capturing with another pod's metadata; try again",
        )
    if not pod.uid:
        pod = replace(pod, uid=uid)
    return pod, namespace


def source_problems(source: Any) -> str:
    """What the source reports as wrong (e.g. unparsable manifests), for error details."""
    seen: list[str] = []
    while source is not None:
        for problem in getattr(source, "problems", None) or []:
            if str(problem) not in seen:
                seen.append(str(problem))
        source = getattr(source, "inner", None)
    return "; ".join(seen[:5])
