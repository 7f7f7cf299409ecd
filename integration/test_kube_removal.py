"""In Kubernetes: when the agent exits because its DaemonSet is being deleted, it releases
every pod first (after cni-install took the entry out); an agent restart while the
DaemonSet stays (an upgrade) keeps every pod captured."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agent.netns import nft
from agent.testing.apiserver import FakeApiServer
from agent.testing.kubelet import Kubelet
from integration.conftest import SUBNET4, SUBNET6
from integration.test_kube_agent import (  # noqa: F401 - fixtures
    KubeAgent,
    _cleanup_pods,
    api,
    new_pod,
)

pytestmark = [pytest.mark.integration]

DS = {"apiVersion": "apps/v1", "kind": "DaemonSet",
      "metadata": {"name": "aether-agent", "namespace": "aether-system"}, "spec": {}}


@pytest.fixture
def dsagent(api: FakeApiServer, workdir: str,  # noqa: F811 - the imported fixture
            bridge_name: str) -> Iterator[tuple[KubeAgent, Kubelet]]:
    api.put_object(DS)
    kc = api.kubeconfig(os.path.join(workdir, "kubeconfig"))
    agent = KubeAgent(workdir, kc, extra=["--daemonset-name", "aether-agent",
                                          "--daemonset-namespace", "aether-system"])
    agent.start()
    kubelet = Kubelet(workdir, bridge_name, SUBNET4, SUBNET6,
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    yield agent, kubelet
    agent.stop()


def test_an_upgrade_keeps_capture_and_a_daemonset_deletion_releases(
        api: FakeApiServer, dsagent: tuple[KubeAgent, Kubelet]) -> None:  # noqa: F811
    agent, k = dsagent
    pod = new_pod(api, k)
    k.add(pod)
    assert nft.list_table_text(pod.netns) is not None
    agent.stop()  # DaemonSet still there: an upgrade or a restart
    assert nft.list_table_text(pod.netns) is not None
    agent.start()
    assert [p["pod"] for p in agent.status()["pods"]] == [f"app/{pod.name}"]
    assert api.delete_object("DaemonSet", "aether-agent", "aether-system", "apps/v1")
    agent.stop()
    assert nft.list_table_text(pod.netns) is None  # released before the agent exited
    assert "our DaemonSet is being deleted: releasing all 1 captured pods" in agent.logs()
    assert [n for n in os.listdir(os.path.join(agent.run_dir, "pods"))
            if n.endswith(".json")] == []
