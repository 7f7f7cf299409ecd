"""Capture integrity end to end (issue #12, items 6 and 7): real netns, real nftables.

Only pods' netns, only their own: the node's netns is never captured, a container id acts
only on the netns its record owns. Unknown is not "no": a pod or namespace the manifests
cannot answer for is CNI try-again, never a pod started uncaptured.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from agent.netns import nft
from agent.testing.kubelet import CniError, Pod, exec_plugin
from integration.conftest import Node

PREV = {"cniVersion": "1.0.0", "interfaces": [], "ips": []}


def host_has_aether_table() -> bool:
    return subprocess.run(["nft", "list", "table", "inet", "aether"], capture_output=True,
                          check=False).returncode == 0


@pytest.fixture
def clean_host() -> Iterator[None]:
    assert not host_has_aether_table(), "the host netns already holds an inet aether table"
    yield
    if host_has_aether_table():  # never leave one behind, whatever the test did
        subprocess.run(["nft", "delete", "table", "inet", "aether"], check=False)
        pytest.fail("an inet aether table was programmed in the node's own netns")


def _readable(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except PermissionError:
        return False


def other_container(pod: Pod, netns: str = "") -> Pod:
    """Another container id for the same pod (and, unless told, the same netns)."""
    return dataclasses.replace(pod, container_id=f"c{uuid.uuid4().hex[:10]}{'1' * 20}",
                               netns_override=netns or pod.netns_override, result=dict(PREV))


def aether_add(node: Node, pod: Pod) -> dict[str, object]:
    if not pod.result:
        pod.result = dict(PREV)
    return node.kubelet.add_aether_only(pod)


# ---- item 6 ---------------------------------------------------------------------------------


def test_add_naming_the_nodes_netns_is_refused(node: Node, clean_host: None) -> None:
    assert node.agent.proc is not None
    agent_pid = node.agent.proc.pid
    attached = f"aet-host-{uuid.uuid4().hex[:6]}"  # a /var/run/netns name bound to the node's
    subprocess.run(["ip", "netns", "attach", attached, str(agent_pid)], check=True)
    try:
        paths = ["/proc/1/ns/net", f"/proc/{agent_pid}/ns/net", f"/var/run/netns/{attached}"]
        for path in paths:
            pod = node.pod()  # a managed pod: it would be captured
            pod.netns_override = path
            with pytest.raises(CniError) as err:
                aether_add(node, pod)
            assert err.value.result["code"] == 4, err.value
            if _readable(path):
                assert "node's own network namespace" in err.value.msg
            else:  # some sandboxes deny even root /proc/1/ns: refused all the same
                assert "cannot be opened" in err.value.msg
            assert not host_has_aether_table()
            assert not os.path.exists(os.path.join(node.agent.run_dir, "netns",
                                                   pod.container_id))
            node.pods.remove(pod)
        assert node.agent.status()["pods"] == []
    finally:
        subprocess.run(["ip", "netns", "delete", attached], check=False)


def test_del_of_an_unknown_container_leaves_a_captured_pod_captured(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    fp = nft.live_fingerprint(pod.netns)
    assert fp is not None
    node.kubelet.delete_aether_only(other_container(pod))  # succeeds, changes nothing
    assert nft.live_fingerprint(pod.netns) == fp
    assert [p["pod"] for p in node.agent.status()["pods"]] == [f"app/{pod.name}"]
    node.kubelet.check(pod)


def test_del_of_an_unknown_container_still_cleans_a_crashed_add(node: Node) -> None:
    """The cleanup a DEL does for an id the agent never recorded stays for unowned netns."""
    pod = node.pod()
    node.add(pod)
    records = os.path.join(node.agent.run_dir, "pods")
    node.agent.stop()
    for name in os.listdir(records):  # the agent "crashed" after programming, before recording
        os.unlink(os.path.join(records, name))
    node.agent.start()
    assert nft.list_table_text(pod.netns) is not None
    node.kubelet.delete_aether_only(pod)
    assert nft.list_table_text(pod.netns) is None


def test_add_of_a_second_container_into_a_captured_netns_is_refused(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    fp = nft.live_fingerprint(pod.netns)
    # the same namespace by another path: /proc/<pid>/ns/net of a process inside it
    sleeper = subprocess.Popen(["ip", "netns", "exec", pod.netns_name, "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        proc_path = f"/proc/{sleeper.pid}/ns/net"
        while time.monotonic() < deadline and \
                os.stat(proc_path).st_ino != os.stat(pod.netns).st_ino:
            time.sleep(0.02)  # until `ip netns exec` has entered the namespace
        for intruder in (other_container(pod), other_container(pod, proc_path)):
            with pytest.raises(CniError) as err:
                aether_add(node, intruder)
            assert err.value.result["code"] == 4
            assert f"already captured for app/{pod.name} (container {pod.container_id})" \
                in err.value.msg
            assert not os.path.exists(os.path.join(node.agent.run_dir, "netns",
                                                   intruder.container_id))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert nft.live_fingerprint(pod.netns) == fp
    assert [p["container_id"] for p in node.agent.status()["pods"]] == [pod.container_id]
    assert node.kubelet.add_aether_only(pod) == pod.result  # the owner's retry: idempotent
    node.kubelet.check(pod)


def test_check_of_a_managed_pod_never_captured_fails(node: Node) -> None:
    pod = node.pod()
    node.kubelet.create_sandbox(pod)
    bridge = dict(node.kubelet.conflist["plugins"][0], name="aether-test", cniVersion="1.0.0")
    pod.result = exec_plugin(node.kubelet.plugin_dir, "bridge", "ADD", bridge, pod.container_id,
                             pod.netns, "eth0", pod.cni_args)  # aether-cni never ran
    with pytest.raises(CniError) as err:
        node.kubelet.check(pod)
    assert err.value.result["code"] == 102
    assert f"app/{pod.name} is to be captured" in err.value.msg
    # an unmanaged pod without capture is fine
    plain = node.pod(namespace="plain")
    node.add(plain)
    node.kubelet.check(plain)


# ---- item 7 ---------------------------------------------------------------------------------


def _add_is_never_uncaptured(node: Node, pod: Pod) -> str:
    """ADD answers try-again, or captures: 'captured' / 'try-again'."""
    try:
        node.add(pod)
    except CniError as e:
        assert e.result.get("code") == 11, e
        assert nft.list_table_text(pod.netns) is None
        return "try-again"
    assert nft.list_table_text(pod.netns) is not None, "ADD answered 0 but the pod is uncaptured"
    return "captured"


def test_namespaces_file_with_a_syntax_error_keeps_the_last_good_version(node: Node) -> None:
    first = node.pod()
    node.add(first)  # the agent has read the good namespaces
    path = os.path.join(node.agent.manifests, "namespaces.yaml")
    with open(path, "w") as f:
        f.write("- {apiVersion: v1, kind: Namespace, metadata: {name: app, labels: [\n")
    for _ in range(3):
        assert _add_is_never_uncaptured(node, node.pod()) == "captured"
        time.sleep(0.3)  # across watcher polls
    st = node.agent.status()
    assert any("namespaces.yaml" in p and "last good" in p for p in st["source_problems"])


def test_namespaces_file_mid_rewrite_never_starts_a_pod_uncaptured(node: Node) -> None:
    node.add(node.pod())
    path = os.path.join(node.agent.manifests, "namespaces.yaml")
    with open(path) as f:
        good = f.read()
    with open(path, "w") as f:  # truncated: the first step of an in-place rewrite
        f.flush()
        time.sleep(0.2)
        assert _add_is_never_uncaptured(node, node.pod()) in ("captured", "try-again")
        f.write(good[: len(good) // 2])  # half written
        f.flush()
        assert _add_is_never_uncaptured(node, node.pod()) in ("captured", "try-again")
        f.write(good[len(good) // 2:])
    assert _add_is_never_uncaptured(node, node.pod()) == "captured"


def test_unparsable_namespaces_from_the_start_is_try_again(node: Node) -> None:
    node.agent.stop()
    with open(os.path.join(node.agent.manifests, "namespaces.yaml"), "w") as f:
        f.write("{{{ this is not yaml\n")
    node.agent.start()
    for ns in ("app", "plain"):  # managed or not, nobody can tell: never "not managed"
        pod = node.pod(namespace=ns)
        with pytest.raises(CniError) as err:
            node.add(pod)
        assert err.value.result["code"] == 11
        assert f"namespace {ns} of pod {ns}/{pod.name} is not known" in err.value.msg
        assert "namespaces.yaml" in err.value.result["details"]
        assert nft.list_table_text(pod.netns) is None
    assert any("namespaces.yaml" in p for p in node.agent.status()["source_problems"])


def test_pod_without_a_manifest_is_try_again_then_captured(node: Node) -> None:
    pod = node.kubelet.new_pod("app", f"late-{uuid.uuid4().hex[:6]}")
    node.pods.append(pod)
    with pytest.raises(CniError) as err:
        node.add(pod)
    assert err.value.result["code"] == 11
    assert f"pod app/{pod.name} is not known" in err.value.msg
    assert nft.list_table_text(pod.netns) is None
    assert node.agent.status()["pods"] == []
    # kubelet tears the sandbox down and retries; by then the pod is known
    node.kubelet.delete(pod)
    node.agent.add_pod(pod)
    node.add(pod)
    assert nft.list_table_text(pod.netns) is not None
