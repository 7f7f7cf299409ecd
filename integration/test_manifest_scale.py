"""The real agent beside big, broken and hostile manifests (issue #13, item 5), root.

`aether-agent run --manifests DIR --no-envoy`, pods added as kubelet does (primary plugin,
then aether-cni, retried on try-again). Every aether-cni ADD attempt is timed: none may take
a second, whatever the manifest directory holds or is doing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

from agent.testing.kubelet import CniError, Pod, exec_plugin
from integration.conftest import Node

BIG_PODS = 50_000
ADD_BUDGET_S = 1.0

# measured ADD times, printed at the end of each test (pytest -s shows them)
TIMES: dict[str, list[float]] = {}


def big_manifest(n: int = BIG_PODS, managed0: str = "false") -> bytes:
    """~8 MB: a managed Namespace `bulk` and n Pods in it; bulk-00000 opts out (one line)."""
    parts = ['apiVersion: v1\nkind: Namespace\nmetadata:\n  name: bulk\n  labels:\n'
             '    aether.io/managed: "true"\n']
    for i in range(n):
        label = f'    aether.io/managed: "{managed0}"\n' if i == 0 else ""
        parts.append(
            f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: bulk-{i:05d}\n  namespace: bulk\n"
            f"  labels:\n    app: bulk-{i % 500:03d}\n{label}"
            f"spec:\n  nodeName: elsewhere-{i % 100}\n  serviceAccountName: bulk\n")
    return "---\n".join(parts).encode()


def billion_laughs(levels: int = 9) -> bytes:
    lines = ['  lol0: &lol0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"  lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]")
    return ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: laughs, namespace: app}\ndata:\n"
            + "\n".join(lines) + "\n").encode()


def write_atomically(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def timed_add(node: Node, pod: Pod, label: str, deadline_s: float = 60.0) -> dict[str, Any]:
    """bridge ADD, then aether-cni ADD retried on code 11 as kubelet does; every aether-cni
    attempt timed into TIMES[label] and held to the budget."""
    kl = node.kubelet
    kl.create_sandbox(pod)
    bridge = kl.conflist["plugins"][0]
    pod.result = exec_plugin(kl.plugin_dir, "bridge", "ADD",
                             dict(bridge, name=kl.conflist["name"], cniVersion=kl.cni_version),
                             pod.container_id, pod.netns, "eth0", pod.cni_args)
    deadline = time.monotonic() + deadline_s
    while True:
        started = time.monotonic()
        try:
            result = kl.add_aether_only(pod)
        except CniError as e:
            took = time.monotonic() - started
            TIMES.setdefault(label, []).append(took)
            assert took < ADD_BUDGET_S, f"ADD of {pod.name} answered {e.result} after {took:.2f}s"
            assert e.result.get("code") == 11, e.result
            assert time.monotonic() < deadline, f"{pod.name} never got past try-again: {e.result}"
            time.sleep(0.2)
            continue
        took = time.monotonic() - started
        TIMES.setdefault(label, []).append(took)
        assert took < ADD_BUDGET_S, f"ADD of {pod.name} took {took:.2f}s"
        return result


def add_and_delete(node: Node, pod: Pod, label: str) -> None:
    """A timed ADD, then the pod goes again: the node stays small, so the status calls the
    test makes stay cheap for the agent (status checks every captured pod's rules)."""
    timed_add(node, pod, label)
    node.kubelet.delete(pod)
    node.pods.remove(pod)


def bulk_pod(node: Node, name: str) -> Pod:
    """A sandbox for a pod the big manifest defines (no manifest written for it)."""
    pod = node.kubelet.new_pod("bulk", name)
    node.pods.append(pod)
    return pod


def captured(node: Node) -> set[str]:
    return {p["pod"] for p in node.agent.status()["pods"]}


def loading(node: Node) -> bool:
    return any("being parsed in the background" in p
               for p in node.agent.status()["source_problems"])


def wait_until_loading(node: Node) -> None:
    """The watcher (polling every 0.5 s) has seen the big file change."""
    deadline = time.monotonic() + 5
    while not loading(node):
        assert time.monotonic() < deadline, "the big file was never seen"
        time.sleep(0.1)


def report(label: str) -> None:
    t = TIMES.get(label, [])
    if t:
        print(f"\n{label}: {len(t)} ADD attempts, max {max(t) * 1000:.0f} ms, "
              f"mean {sum(t) / len(t) * 1000:.0f} ms")


def test_bad_and_huge_manifests_beside_normal_ones_never_slow_an_add(node: Node) -> None:
    assert node.agent.proc is not None
    agent = psutil.Process(node.agent.proc.pid)
    timed_add(node, node.pod(), "baseline")
    rss0 = agent.memory_info().rss
    m = node.agent.manifests
    with open(os.path.join(m, "latin1.yaml"), "wb") as f:
        f.write(b"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: caf\xe9, namespace: app}\n")
    with open(os.path.join(m, "list.yaml"), "w") as f:
        f.write("apiVersion: v1\nkind: List\nitems: 5\n")
    big = os.path.join(m, "bulk.yaml")
    data = big_manifest()
    assert len(data) > 8_000_000
    write_atomically(big, data)

    # ADDs of ordinary pods while the 50k-object file loads: each answered at once
    # (status, which the loop asks once a second, is not cheap for the agent either)
    during = 0
    started = time.monotonic()
    wait_until_loading(node)
    while True:
        still = loading(node)
        asked = time.monotonic()
        while time.monotonic() - asked < 1.0:
            add_and_delete(node, node.pod(), "while the big file loads")
            during += still
        if not still:
            break
        assert time.monotonic() - started < 120, "the big file never finished loading"
    load_s = time.monotonic() - started
    timed_add(node, node.pod(), "after the big file loaded")
    timed_add(node, bulk_pod(node, "bulk-00001"), "pods of the big file")
    assert "bulk/bulk-00001" in captured(node)
    st = node.agent.status()
    problems = st["source_problems"]
    assert any("latin1.yaml" in p and "not UTF-8" in p for p in problems), problems
    assert any("list.yaml" in p and "items are not a list" in p for p in problems), problems
    rss1 = agent.memory_info().rss
    report("while the big file loads")
    print(f"big file: {len(data) / 1e6:.1f} MB, loaded within {load_s:.1f}s; {during} ADDs "
          f"were answered while it loaded; agent RSS {rss0 / 1e6:.0f} -> {rss1 / 1e6:.0f} MB")

    # a one-line edit of the big file (in place, as an editor without backups writes it)
    edited = data.replace(b'aether.io/managed: "false"', b'aether.io/managed: "true"', 1)
    assert len(edited) == len(data) - 1
    with open(big, "wb") as f:
        f.write(edited)
    started = time.monotonic()
    i = 2
    wait_until_loading(node)
    while True:
        still = loading(node)
        asked = time.monotonic()
        while time.monotonic() - asked < 1.0:
            add_and_delete(node, node.pod(), "while the edited big file reloads")
            add_and_delete(node, bulk_pod(node, f"bulk-{i:05d}"),
                           "while the edited big file reloads")
            i += 1
        if not still:
            break
        assert time.monotonic() - started < 120, "the edit never finished loading"
    reload_s = time.monotonic() - started
    # the edit counts: bulk-00000 opted out before, it is captured now (once the watch cache,
    # which answers ADD first, has the new version: it polls every 0.5 s)
    deadline = time.monotonic() + 15
    while True:
        pod = bulk_pod(node, "bulk-00000")
        timed_add(node, pod, "after the edit")
        if "bulk/bulk-00000" in captured(node):
            break
        assert time.monotonic() < deadline, "the edited line never took effect"
        node.kubelet.delete(pod)
        node.pods.remove(pod)
        time.sleep(0.5)
    rss2 = agent.memory_info().rss
    report("while the edited big file reloads")
    print(f"edit reloaded within {reload_s:.1f}s; agent RSS {rss2 / 1e6:.0f} MB")

    # a one-line edit of the Namespace: the mesh model re-evaluates all 50k pods of it, in
    # paced chunks (the lock free between them); ADDs meanwhile must stay within budget
    relabelled = edited.replace(b'  labels:\n    aether.io/managed: "true"\n',
                                b'  labels:\n    team: "x"\n    aether.io/managed: "true"\n', 1)
    assert len(relabelled) > len(edited)
    write_atomically(big, relabelled)
    wait_until_loading(node)
    settled_at = None
    while settled_at is None or time.monotonic() - settled_at < 6.0:
        add_and_delete(node, node.pod(), "while the Namespace edit is applied")
        if settled_at is None and not loading(node):
            settled_at = time.monotonic()
    report("while the Namespace edit is applied")

    assert node.agent.proc.poll() is None
    assert "Traceback" not in node.agent.logs()
    for label in TIMES:
        report(label)


def test_an_alias_bomb_beside_normal_manifests_costs_no_memory(node: Node) -> None:
    assert node.agent.proc is not None
    agent = psutil.Process(node.agent.proc.pid)
    timed_add(node, node.pod(), "before the bomb")
    rss0 = agent.memory_info().rss
    write_atomically(os.path.join(node.agent.manifests, "laughs.yaml"), billion_laughs())
    deadline = time.monotonic() + 20
    while not any("laughs.yaml" in p for p in node.agent.status()["source_problems"]):
        assert time.monotonic() < deadline, "the bomb was never reported"
        time.sleep(0.1)
    for _ in range(5):
        timed_add(node, node.pod(), "beside the alias bomb")
    rss1 = agent.memory_info().rss
    (problem,) = [p for p in node.agent.status()["source_problems"] if "laughs.yaml" in p]
    assert "alias bomb" in problem
    assert rss1 - rss0 < 30_000_000, (rss0, rss1)
    assert len(captured(node)) == 6
    report("beside the alias bomb")
    print(f"alias bomb: agent RSS {rss0 / 1e6:.0f} -> {rss1 / 1e6:.0f} MB; reported: {problem}")


def test_an_agent_started_beside_a_huge_manifest_serves_adds_fast(node: Node) -> None:
    write_atomically(os.path.join(node.agent.manifests, "bulk.yaml"), big_manifest())
    node.agent.stop()
    started = time.monotonic()
    node.agent.start()
    up_s = time.monotonic() - started
    for _ in range(3):
        timed_add(node, node.pod(), "after a start beside the big file")
    timed_add(node, bulk_pod(node, "bulk-00003"), "after a start beside the big file")
    report("after a start beside the big file")
    print(f"agent up {up_s:.1f}s after its start with the 8 MB file")
