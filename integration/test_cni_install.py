"""The installed plugin, run from a host bin dir the way kubelet runs it, with the agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from agent.install import conflist as cl
from agent.install import runtime as rt
from agent.install.installer import Installer, InstallOptions
from agent.testing.netutil import capture_listener, dial, host_server
from integration.conftest import GW4, Node

pytestmark = pytest.mark.integration


def run_masked(cmd: str) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with this Python's prefix hidden: a host without our Python."""
    prefixes = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})
    mounts = " && ".join(f"mount -t tmpfs none '{p}'" for p in prefixes)
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"{mounts} && {cmd}"], capture_output=True, text=True, timeout=60,
                          check=False)


def test_copied_runtime_runs_without_the_image_python(tmp_path: str) -> None:
    bin_dir = os.path.join(str(tmp_path), "opt-cni-bin")
    changed, python = rt.install_plugin(bin_dir, "copy")
    assert changed and python.startswith(bin_dir)
    shim = os.path.join(bin_dir, "aether-cni")
    # sanity: the mask really hides the interpreter we run under
    hidden = run_masked(f"test -e '{os.path.realpath(sys.executable)}'")
    assert hidden.returncode != 0
    proc = run_masked(f"env -i CNI_COMMAND=VERSION '{shim}' </dev/null")
    assert proc.returncode == 0, proc.stderr
    assert "1.0.0" in json.loads(proc.stdout)["supportedVersions"]
    # and an ADD without an agent fails closed with a CNI error, not a Python traceback
    conf = json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "aether-cni",
                       "agent_socket": os.path.join(str(tmp_path), "none.sock"),
                       "prevResult": {"cniVersion": "1.0.0", "ips": []}})
    proc = run_masked(f"echo '{conf}' | env -i CNI_COMMAND=ADD CNI_NETNS=/proc/1/ns/net "
                      f"CNI_CONTAINERID=c CNI_IFNAME=eth0 '{shim}'")
    assert proc.returncode == 1 and json.loads(proc.stdout)["code"] == 100, proc


@pytest.fixture
def installed_node(workdir: str, bridge_name: str) -> Iterator[Node]:
    """A node whose CNI config and aether-cni come from cni-install, not from the test."""
    n = Node(workdir, bridge_name)
    conf_dir = os.path.join(workdir, "net.d")
    os.makedirs(conf_dir)
    primary = dict(n.kubelet.conflist, plugins=n.kubelet.conflist["plugins"][:1])
    with open(os.path.join(conf_dir, "10-bridge.conflist"), "w") as f:
        json.dump(primary, f)
    # the kubelet's plugin dir holds a symlink to the dev console script: replaced by ours
    inst = Installer(InstallOptions(
        cni_conf_dir=conf_dir, cni_bin_dir=n.kubelet.plugin_dir, python_runtime="copy",
        netconf=cl.NetconfOptions(agent_socket=n.agent.socket,
                                  capture_redirect_all_default=True)))
    assert inst.install(timeout=5)
    shim = os.path.join(n.kubelet.plugin_dir, "aether-cni")
    assert not os.path.islink(shim)
    with open(shim) as f:
        assert f.readline().startswith(f"#!{n.kubelet.plugin_dir}/aether/runtime/")
    # kubelet reads what the installer wrote
    with open(os.path.join(conf_dir, "10-bridge.conflist")) as f:
        n.kubelet.conflist = json.load(f)
    assert n.kubelet.conflist["plugins"][-1]["type"] == "aether-cni"
    n.agent.start()
    yield n
    n.cleanup()
    n.agent.stop()
    inst.uninstall()


def test_installed_plugin_captures_end_to_end(installed_node: Node) -> None:
    node = installed_node
    pod = node.pod()
    result = node.add(pod)
    assert result["ips"]
    st = node.agent.status()
    assert [p["pod"] for p in st["pods"]] == [pod.namespace + "/" + pod.name]
    assert st["pods"][0]["rules"] == "ok" and st["pods"][0]["mode"] == "redirect-all"
    cap = capture_listener(pod.netns)
    srv, port = host_server()
    try:
        assert dial(pod.netns, GW4, port) == "captured"
    finally:
        cap.close()
        srv.close()
    node.kubelet.delete(pod)
    node.pods.remove(pod)
    assert node.agent.status()["pods"] == []
