"""CNI 1.1 STATUS and GC, the way libcni calls them, through both shims (native and Python)
against the real agent: STATUS answers 0 while the agent serves, 50 when it is gone; GC
releases every capture whose attachment is not in cni.dev/valid-attachments."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from typing import Any

import pytest

from agent.cni import plugin as python_shim
from agent.netns import nft
from agent.testing.kubelet import CniError, exec_plugin
from integration.conftest import EnvoyNode, Node


def _conf(node: Node, **extra: Any) -> dict[str, Any]:
    plugin = node.kubelet.conflist["plugins"][-1]
    return dict(plugin, name="aether-test", cniVersion="1.1.0", **extra)


@pytest.fixture(params=["native", "python"])
def shim(request: pytest.FixtureRequest, node: Node) -> str:
    """The plugin dir's aether-cni: the native one, or the Python shim in its place."""
    if request.param == "python":
        path = os.path.join(node.kubelet.plugin_dir, "aether-cni")
        os.unlink(path)
        shutil.copy(python_shim.__file__, path)
        with open(path) as f:
            body = f.read()
        with open(path, "w") as f:
            f.write(f"#!{os.path.realpath(sys.executable)} -IS\n" + body)
        os.chmod(path, 0o755)
    return str(request.param)


def _status(node: Node) -> None:
    exec_plugin(node.kubelet.plugin_dir, "aether-cni", "STATUS", _conf(node), "", "", "", "")


def test_status_ok_with_the_agent_and_50_without(node: Node, shim: str) -> None:
    _status(node)
    node.agent.stop()
    with pytest.raises(CniError) as err:
        _status(node)
    assert err.value.result["code"] == 50, err.value.result
    assert "not available" in err.value.msg
    node.agent.start()
    _status(node)


def test_gc_releases_captures_not_in_valid_attachments(node: Node, shim: str) -> None:
    keep, drop = node.pod(), node.pod()
    node.add(keep)
    node.add(drop)
    valid = [{"containerID": keep.container_id, "ifname": "eth0"}]
    exec_plugin(node.kubelet.plugin_dir, "aether-cni", "GC",
                _conf(node, **{"cni.dev/valid-attachments": valid}), "", "", "", "")
    pods = [p["pod"] for p in node.agent.status()["pods"]]
    assert pods == [f"{keep.namespace}/{keep.name}"]
    assert nft.list_table_text(drop.netns) is None  # its rules are gone, its netns remains
    assert nft.list_table_text(keep.netns) is not None


def test_status_is_50_while_the_node_proxy_is_not_ready(enode: EnvoyNode) -> None:
    _status(enode)
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)  # hung: its admin does not answer /ready
    try:
        with pytest.raises(CniError) as err:
            _status(enode)
        assert err.value.result["code"] == 50, err.value.result
        assert "not ready" in err.value.msg
    finally:
        os.kill(pid, signal.SIGCONT)
    _status(enode)
