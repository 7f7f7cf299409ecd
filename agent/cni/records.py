"""The records the capture lifecycle writes to the state store, built from what a step read:
the CapturedPod of a completed ADD, and the SeenPod of a pod remembered uncaptured (an ADD
that did not capture it, or a live release) for a later live enrollment."""

from __future__ import annotations

import time

from agent.capture.policy import CaptureDecision, CapturePolicy
from agent.cni.messages import CniRequest
from agent.cni.pod_lookup import redirect_all_default
from agent.cni.state import CapturedPod, SeenPod
from agent.source.model import PodMeta


def captured_record(req: CniRequest, pod: PodMeta, decision: CaptureDecision, policy: CapturePolicy,
                    *, netns: str, fingerprint: str, pinned: bool,
                    loopback: tuple[bool, bool]) -> CapturedPod:
    """The record of `pod` captured by `req` in `netns` (the pin when it pinned), with the
    fingerprint and the loopback families the capture's visit there read."""
    return CapturedPod(
        container_id=req.container_id,
        uid=pod.uid,
        namespace=pod.namespace,
        name=pod.name,
        service_account=pod.service_account,
        netns=netns,
        kubelet_netns=req.netns,
        ifname=req.ifname,
        ips=list(req.ips),
        policy=policy,
        fingerprint=fingerprint,
        reason=decision.reason,
        problems=list(decision.problems),
        pinned=pinned,
        captured_at=time.time(),
        net_admin=pod.net_admin,
        redirect_all_default=redirect_all_default(req.netconf),
        workload=pod.workload,
        loopback=loopback,
        labels=dict(pod.labels),
    )


def seen_from_add(req: CniRequest, pod: PodMeta, netns_id: list[int]) -> SeenPod:
    """An ADD's pod not captured, in the netns of identity `netns_id`."""
    return SeenPod(
        container_id=req.container_id, uid=pod.uid, namespace=pod.namespace,
        name=pod.name, kubelet_netns=req.netns, ifname=req.ifname, ips=list(req.ips),
        netns_id=netns_id, seen_at=time.time(),
        redirect_all_default=redirect_all_default(req.netconf))


def seen_from_release(container_id: str, record: CapturedPod, netns_id: list[int]) -> SeenPod:
    """The captured pod of `container_id` released live, its kubelet netns still of identity
    `netns_id`."""
    return SeenPod(
        container_id=container_id, uid=record.uid, namespace=record.namespace,
        name=record.name, kubelet_netns=record.kubelet_netns,
        ifname=record.ifname, ips=list(record.ips), netns_id=netns_id,
        redirect_all_default=record.redirect_all_default, seen_at=time.time())
