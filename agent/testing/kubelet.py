"""Drive CNI plugins exactly as kubelet + containerd do (libcni semantics), for tests and the demo.

containerd brings `lo` up with the loopback plugin first, then runs the conflist's plugins in
order, injecting `name`, `cniVersion` and the previous plugin's result as `prevResult`. DEL runs
the list in reverse with the cached ADD result; CHECK runs it in order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
from dataclasses import dataclass, field
from typing import Any

REFERENCE_PLUGIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")


def reference_plugin_dir() -> str:
    for d in REFERENCE_PLUGIN_DIRS:
        if os.path.exists(os.path.join(d, "bridge")):
            return d
    raise RuntimeError("containernetworking-plugins not installed (bridge plugin not found)")


def aether_cni_path() -> str:
    """The installed console script, without any pyenv shim in between."""
    candidate = os.path.join(sysconfig.get_path("scripts"), "aether-cni")
    if os.path.exists(candidate):
        return candidate
    found = shutil.which("aether-cni")
    if not found:
        raise RuntimeError("aether-cni is not installed (pip install -e .)")
    return found


def make_plugin_dir(base: str) -> str:
    """A CNI_PATH dir holding the reference plugins and aether-cni, like /opt/cni/bin."""
    path = os.path.join(base, "cni-bin")
    os.makedirs(path, exist_ok=True)
    ref = reference_plugin_dir()
    for name in ("bridge", "host-local", "loopback"):
        dst = os.path.join(path, name)
        if not os.path.exists(dst):
            os.symlink(os.path.join(ref, name), dst)
    # the lean standalone shim, as cni-install puts it on a node
    from agent.cni.shim import write_shim
    write_shim(os.path.join(path, "aether-cni"))
    return path


class CniError(Exception):
    def __init__(self, plugin: str, rc: int, out: str, err: str) -> None:
        try:
            self.result: dict[str, Any] = json.loads(out) if out.strip() else {}
        except ValueError:
            self.result = {"raw": out}
        super().__init__(f"{plugin} exited {rc}: {out.strip()} {err.strip()}")
        self.rc, self.stdout, self.stderr = rc, out, err

    @property
    def msg(self) -> str:
        return str(self.result.get("msg", ""))


def exec_plugin(plugin_dir: str, plugin: str, command: str, netconf: dict[str, Any],
                container_id: str, netns: str, ifname: str, cni_args: str,
                timeout: float = 60.0) -> dict[str, Any]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": ifname,
        "CNI_ARGS": cni_args,
        "CNI_PATH": plugin_dir,
    }
    proc = subprocess.run([os.path.join(plugin_dir, plugin)], input=json.dumps(netconf),
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise CniError(plugin, proc.returncode, proc.stdout, proc.stderr)
    out: dict[str, Any] = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return out


@dataclass
class Pod:
    namespace: str
    name: str
    uid: str
    netns_name: str
    container_id: str
    result: dict[str, Any] = field(default_factory=dict)
    netns_override: str = ""  # e.g. /proc/<pid>/ns/net, as some runtimes pass it

    @property
    def netns(self) -> str:
        return self.netns_override or f"/var/run/netns/{self.netns_name}"

    @property
    def cni_args(self) -> str:
        return (f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.namespace};K8S_POD_NAME={self.name};"
                f"K8S_POD_INFRA_CONTAINER_ID={self.container_id};K8S_POD_UID={self.uid}")

    def ip(self, family: int = 4) -> str:
        for entry in self.result.get("ips", []):
            addr = entry["address"].split("/")[0]
            if (":" in addr) == (family == 6):
                return str(addr)
        raise LookupError(f"pod has no IPv{family} address")


class Kubelet:
    """A node's CNI runtime: a conflist of bridge + host-local (+ aether-cni chained)."""

    def __init__(self, workdir: str, bridge: str, subnet4: str, subnet6: str,
                 aether: dict[str, Any] | None, cni_version: str = "1.0.0") -> None:
        self.workdir = workdir
        self.plugin_dir = make_plugin_dir(workdir)
        self.cni_version = cni_version
        plugins: list[dict[str, Any]] = [{
            "type": "bridge",
            "bridge": bridge,
            "isGateway": True,
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet4}], [{"subnet": subnet6}]],
                # default routes via the bridge, as every real pod network has
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                "dataDir": os.path.join(workdir, "ipam"),
            },
        }]
        if aether is not None:
            plugins.append({"type": "aether-cni", **aether})
        self.conflist: dict[str, Any] = {"cniVersion": cni_version, "name": "aether-test",
                                         "plugins": plugins}

    def new_pod(self, namespace: str, name: str) -> Pod:
        suffix = uuid.uuid4().hex[:10]
        return Pod(namespace, name, str(uuid.uuid4()), f"aet-{suffix}", f"c{suffix}{'0' * 20}")

    def create_sandbox(self, pod: Pod) -> None:
        subprocess.run(["ip", "netns", "add", pod.netns_name], check=True)
        exec_plugin(self.plugin_dir, "loopback", "ADD",
                    {"cniVersion": self.cni_version, "name": "cni-loopback", "type": "loopback"},
                    pod.container_id, pod.netns, "lo", pod.cni_args)

    def add(self, pod: Pod, create: bool = True) -> dict[str, Any]:
        if create:
            self.create_sandbox(pod)
        prev: dict[str, Any] | None = None
        for plugin in self.conflist["plugins"]:
            conf = dict(plugin, name=self.conflist["name"], cniVersion=self.cni_version)
            if prev is not None:
                conf["prevResult"] = prev
            prev = exec_plugin(self.plugin_dir, plugin["type"], "ADD", conf, pod.container_id,
                               pod.netns, "eth0", pod.cni_args)
        pod.result = prev or {}
        return pod.result

    def check(self, pod: Pod) -> None:
        for plugin in self.conflist["plugins"]:
            conf = dict(plugin, name=self.conflist["name"], cniVersion=self.cni_version,
                        prevResult=pod.result)
            exec_plugin(self.plugin_dir, plugin["type"], "CHECK", conf, pod.container_id,
                        pod.netns, "eth0", pod.cni_args)

    def delete(self, pod: Pod, remove_netns: bool = True) -> None:
        errors: list[Exception] = []
        for plugin in reversed(self.conflist["plugins"]):
            conf = dict(plugin, name=self.conflist["name"], cniVersion=self.cni_version)
            if pod.result:
                conf["prevResult"] = pod.result
            try:
                exec_plugin(self.plugin_dir, plugin["type"], "DEL", conf, pod.container_id,
                            pod.netns, "eth0", pod.cni_args)
            except CniError as e:
                errors.append(e)
        if remove_netns:
            subprocess.run(["ip", "netns", "del", pod.netns_name], check=False,
                           capture_output=True)
        if errors:
            raise errors[0]

    def add_aether_only(self, pod: Pod) -> dict[str, Any]:
        """A retried ADD of our plugin alone, with the same prevResult."""
        plugin = self.conflist["plugins"][-1]
        conf = dict(plugin, name=self.conflist["name"], cniVersion=self.cni_version,
                    prevResult=pod.result)
        return exec_plugin(self.plugin_dir, plugin["type"], "ADD", conf, pod.container_id,
                           pod.netns, "eth0", pod.cni_args)

    def delete_aether_only(self, pod: Pod) -> None:
        """DEL of our plugin alone (the primary plugin's DEL is not under test)."""
        plugin = self.conflist["plugins"][-1]
        conf = dict(plugin, name=self.conflist["name"], cniVersion=self.cni_version,
                    prevResult=pod.result)
        exec_plugin(self.plugin_dir, plugin["type"], "DEL", conf, pod.container_id, pod.netns,
                    "eth0", pod.cni_args)


if __name__ == "__main__":  # pragma: no cover - manual poking
    print(reference_plugin_dir(), aether_cni_path(), sys.executable)
