"""The kustomize base in deploy/: DaemonSet shape, and RBAC that is exactly what agent/ calls.

Rendered with `kubectl kustomize` when kubectl is installed, else by applying the
kustomization (resources, namespace, labels, images) by hand, so the checks always run.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
NAMESPACE = "aether-system"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}

Doc = dict[str, Any]


# ---- rendering -------------------------------------------------------------------------------

def render_by_hand() -> list[Doc]:
    """What `kubectl kustomize deploy/` does for the features this base uses."""
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    assert set(kust) <= allowed, f"kustomization uses {set(kust) - allowed}: teach render_by_hand"
    docs: list[Doc] = []
    for res in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / res).read_text()) if d]
    docs = copy.deepcopy(docs)  # YAML anchors alias objects: edit copies
    ns = kust.get("namespace")
    images = {i["name"]: i for i in kust.get("images", [])}
    for d in docs:
        meta = d.setdefault("metadata", {})
        for entry in kust.get("labels", []):
            assert not entry.get("includeSelectors") and not entry.get("includeTemplates")
            meta.setdefault("labels", {}).update(entry["pairs"])
        if ns and d["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = ns
        for s in d.get("subjects") or []:
            if ns and s.get("kind") == "ServiceAccount":
                s["namespace"] = ns
        spec = (d.get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            name, _, tag = c["image"].partition(":")
            if name in images:
                img = images[name]
                c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
    return docs


def render_with_kubectl() -> list[Doc] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True,
                         timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _index(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], Doc]:
    return _index(render_with_kubectl() or render_by_hand())


def test_hand_render_matches_kubectl_when_present():
    """Keeps the fallback honest where kubectl exists; elsewhere checks the hand render."""
    by_hand = _index(render_by_hand())
    assert set(by_hand) == {
        ("Namespace", NAMESPACE), ("ServiceAccount", "aether-agent"),
        ("ClusterRole", "aether-agent"), ("ClusterRole", "aether-agent-repair"),
        ("ClusterRoleBinding", "aether-agent"), ("ClusterRoleBinding", "aether-agent-repair"),
        ("Role", "aether-agent"), ("RoleBinding", "aether-agent"),
        ("ConfigMap", "aether-agent-config"), ("DaemonSet", "aether-agent"),
        ("CustomResourceDefinition", "meshpods.aether.io"),
        ("CustomResourceDefinition", "authorizationpolicies.security.aether.io"),
    }
    rendered = render_with_kubectl()
    if rendered is not None:
        assert _index(rendered) == by_hand


# ---- the DaemonSet ---------------------------------------------------------------------------

def _pod(objs: dict[tuple[str, str], Doc]) -> Doc:
    spec: Doc = objs[("DaemonSet", "aether-agent")]["spec"]["template"]["spec"]
    return spec


def _container(pod: Doc, name: str, init: bool = False) -> Doc:
    found: Doc = next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)
    return found


def _all_containers(pod: Doc) -> list[Doc]:
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def test_daemonset_node_level_settings(objs):
    ds = objs[("DaemonSet", "aether-agent")]
    assert ds["metadata"]["namespace"] == NAMESPACE
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxSurge": 1,
                                                              "maxUnavailable": 0}}
    pod = _pod(objs)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # else hostNetwork gets the node's DNS
    assert pod["hostPID"] is True  # /proc/<pid>/ns/net paths from kubelet must resolve
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["serviceAccountName"] == "aether-agent"
    assert ("ServiceAccount", "aether-agent") in objs
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "aether-agent"  # NodeConfig.agent_labels
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_containers_commands_and_images(objs):
    pod = _pod(objs)
    agent = _container(pod, "agent")
    assert agent["image"] == "aether-agent:0.1.0"
    argv = agent["command"] + agent["args"]
    assert argv[:2] == ["aether-agent", "run"]
    for flag in ("--node-name=$(NODE_NAME)", "--run-dir=/var/run/aether", "--metrics-port=15020",
                 "--repair=$(AETHER_REPAIR)"):
        assert flag in argv
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}

    init = _container(pod, "cni-install", init=True)
    watch = _container(pod, "cni-install-watch")
    assert init["image"] == watch["image"] == "aether-cni-install:0.1.0"
    assert "--watch" not in init["args"] and "--watch" in watch["args"]
    # The watcher re-installs what it sees missing: with other netconf it would fight the init.
    assert [a for a in watch["args"] if a != "--watch"] == init["args"]
    assert init["env"] == watch["env"]
    assert "--cni-conf-dir=/host/etc/cni/net.d" in init["args"]
    assert "--cni-bin-dir=/host/opt/cni/bin" in init["args"]
    # The shim runs on the host: the socket path must be the host path of the run dir.
    assert "--agent-socket=/var/run/aether/cni.sock" in init["args"]


def test_env_references_resolve(objs):
    pod = _pod(objs)
    config = objs[("ConfigMap", "aether-agent-config")]["data"]
    assert config["captureRedirectAllDefault"] == "false"
    for c in _all_containers(pod):
        names = {e["name"] for e in c.get("env", [])}
        for arg in c.get("command", []) + c.get("args", []):
            for ref in re.findall(r"\$\(([A-Z_]+)\)", arg):
                assert ref in names, f"{c['name']}: {arg} uses undefined ${ref}"
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] == "aether-agent-config" and ref["key"] in config, e


def test_security_context_is_capabilities_not_privileged(objs):
    pod = _pod(objs)
    for c in _all_containers(pod):
        sc = c["securityContext"]
        assert not sc.get("privileged"), c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
    agent = _container(pod, "agent")
    assert set(agent["securityContext"]["capabilities"]["add"]) == {"NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"}
    # the API server rejects allowPrivilegeEscalation: false together with SYS_ADMIN
    assert "allowPrivilegeEscalation" not in agent["securityContext"]
    for name, init in (("cni-install", True), ("cni-install-watch", False)):
        sc = _container(pod, name, init)["securityContext"]
        assert "add" not in sc["capabilities"] and sc["allowPrivilegeEscalation"] is False


def test_host_mounts(objs):
    pod = _pod(objs)
    vols = {v["name"]: v for v in pod["volumes"]}
    host = {v["hostPath"]["path"]: (n, v["hostPath"].get("type")) for n, v in vols.items()
            if "hostPath" in v}
    assert set(host) == {"/etc/cni/net.d", "/opt/cni/bin", "/var/run/netns", "/var/run/aether"}
    assert host["/var/run/aether"][1] == "DirectoryOrCreate"
    agent = {m["mountPath"]: m for m in _container(pod, "agent")["volumeMounts"]}
    netns = agent["/var/run/netns"]
    assert vols[netns["name"]]["hostPath"]["path"] == "/var/run/netns"
    assert netns["mountPropagation"] == "HostToContainer"  # netns created after we started
    assert vols[agent["/var/run/aether"]["name"]]["hostPath"]["path"] == "/var/run/aether"
    assert not agent["/var/run/aether"].get("readOnly")
    for path in ("/host/etc/cni/net.d", "/host/opt/cni/bin"):  # readiness reads, never writes
        assert agent[path]["readOnly"] is True
    for c in _all_containers(pod):  # Bidirectional needs privileged: never used
        for m in c.get("volumeMounts", []):
            assert m.get("mountPropagation", "None") in ("None", "HostToContainer"), m


def test_probes_and_resources(objs):
    pod = _pod(objs)
    agent = _container(pod, "agent")
    # two agent pods share a node during a take-over: each probe asks its own agent by name
    assert agent["livenessProbe"]["exec"]["command"] == ["aether-agent", "ready", "--live"]
    assert agent["readinessProbe"]["exec"]["command"] == ["aether-agent", "ready"]
    assert agent["startupProbe"]["exec"]["command"] == ["aether-agent", "ready", "--live"]
    assert "ports" not in agent  # host ports would keep the surge pod off the node
    env = {e["name"]: e for e in agent["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--drain-seconds=30" in agent["args"]
    assert pod["terminationGracePeriodSeconds"] > 30  # the drain fits in the grace period
    for c in _all_containers(pod):
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]


def _flags(command: Any) -> dict[str, Any]:
    return {o: p for p in command.params for o in (*p.opts, *p.secondary_opts)}


def test_agent_flags_exist_in_the_cli(objs):
    """Every flag the manifest passes to `aether-agent run` is one the CLI accepts."""
    from agent import cli

    run = typer.main.get_command(cli.app).commands["run"]  # type: ignore[attr-defined]
    flags = _flags(run)
    agent = _container(_pod(objs), "agent")
    passed = [a.split("=", 1)[0] for a in agent["args"] if a.startswith("--")]
    assert [f for f in passed if f not in flags] == []


def test_cni_install_flags_exist_and_config_env_is_read(objs):
    from agent.install import cli as install_cli

    command = typer.main.get_command(install_cli.app)
    flags = _flags(command)
    for c in (_container(_pod(objs), "cni-install", True), _container(_pod(objs), "cni-install-watch")):
        passed = [a.split("=", 1)[0] for a in c["args"] if a.startswith("--")]
        assert [f for f in passed if f not in flags] == []
    # A click on/off flag takes no "=value": the ConfigMap's true/false arrives via envvar.
    option = flags["--capture-redirect-all-default"]
    assert option.envvar == "CAPTURE_REDIRECT_ALL_DEFAULT"


# ---- RBAC ------------------------------------------------------------------------------------

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)

#: Every Kubernetes client method agent/ calls → (file that calls it, what it needs).
#: test_every_api_call_in_agent_is_in_the_table finds new calls, so this cannot fall behind.
CALLS: dict[str, tuple[str, set[Grant]]] = {
    "read_namespaced_pod": ("agent/source/kube.py", {("", "pods", "get")}),
    "read_namespace": ("agent/source/kube.py", {("", "namespaces", "get")}),
    "create_namespaced_event": ("agent/source/kube.py", {("", "events", "create")}),
    "read_node": ("agent/node/readiness.py", {("", "nodes", "get")}),
    "patch_node": ("agent/node/readiness.py", {("", "nodes", "patch")}),
    # listed, then streamed by kubernetes.watch.Watch (repair of this node's pods)
    "list_pod_for_all_namespaces": ("agent/node/repair.py",
                                    {("", "pods", "list"), ("", "pods", "watch")}),
    "create_namespaced_pod_eviction": ("agent/node/repair.py", {("", "pods/eviction", "create")}),
    "delete_namespaced_pod": ("agent/node/repair.py", {("", "pods", "delete")}),
    "read_namespaced_daemon_set": ("agent/install/kube.py", {("apps", "daemonsets", "get")}),
    "list_endpoint_slice_for_all_namespaces": ("agent/slices/writer.py",
                                               {("discovery.k8s.io", "endpointslices", "list")}),
    "read_namespaced_endpoint_slice": ("agent/slices/writer.py",
                                       {("discovery.k8s.io", "endpointslices", "get")}),
    "create_namespaced_endpoint_slice": ("agent/slices/writer.py",
                                         {("discovery.k8s.io", "endpointslices", "create")}),
    "replace_namespaced_endpoint_slice": ("agent/slices/writer.py",
                                          {("discovery.k8s.io", "endpointslices", "update")}),
    "delete_namespaced_endpoint_slice": ("agent/slices/writer.py",
                                         {("discovery.k8s.io", "endpointslices", "delete")}),
    "read_namespaced_lease": ("agent/gamma/lease.py", {("coordination.k8s.io", "leases", "get")}),
    "create_namespaced_lease": ("agent/gamma/lease.py", {("coordination.k8s.io", "leases", "create")}),
    "replace_namespaced_lease": ("agent/gamma/lease.py", {("coordination.k8s.io", "leases", "update")}),
    "list_custom_object_for_all_namespaces": ("agent/gamma/status.py", {
        ("gateway.networking.k8s.io", "httproutes", "list"),
        ("gateway.networking.k8s.io", "grpcroutes", "list"),
        ("aether.io", "meshpods", "list")}),  # + agent/meshpods/publisher.py (adoption)
    # + get_namespaced_custom_object (re-read on 409)
    "create_namespaced_custom_object": ("agent/meshpods/publisher.py",
                                        {("aether.io", "meshpods", "create"),
                                         ("aether.io", "meshpods", "get")}),
    "replace_namespaced_custom_object": ("agent/meshpods/publisher.py",
                                         {("aether.io", "meshpods", "update")}),
    "delete_namespaced_custom_object": ("agent/meshpods/publisher.py",
                                        {("aether.io", "meshpods", "delete")}),
    # + get_namespaced_custom_object (re-read on 409; get_* is not a scanned prefix)
    "replace_namespaced_custom_object_status": ("agent/gamma/status.py", {
        ("gateway.networking.k8s.io", "httproutes/status", "update"),
        ("gateway.networking.k8s.io", "grpcroutes/status", "update"),
        ("gateway.networking.k8s.io", "httproutes", "get"),
        ("gateway.networking.k8s.io", "grpcroutes", "get")}),
    "list_cluster_custom_object": ("agent/gamma/xmesh.py",
                                   {("gateway.networking.x-k8s.io", "xmeshes", "list")}),
    "create_cluster_custom_object": ("agent/gamma/xmesh.py",
                                     {("gateway.networking.x-k8s.io", "xmeshes", "create")}),
    "replace_cluster_custom_object_status": ("agent/gamma/xmesh.py",
                                             {("gateway.networking.x-k8s.io", "xmeshes/status", "update")}),
}
#: Raw requests (param_serialize): only GETs of KIND_SPECS paths, i.e. list + watch.
WATCH_EVIDENCE = ("agent/source/watch.py", '"watch": "true"')
_VERB_PREFIXES = ("read_", "list_", "create_", "patch_", "replace_", "delete_", "connect_")


def _client_methods() -> set[str]:
    from kubernetes import client

    apis = (client.CoreV1Api, client.AppsV1Api, client.DiscoveryV1Api, client.CoordinationV1Api,
            client.PolicyV1Api, client.EventsV1Api, client.RbacAuthorizationV1Api,
            client.CustomObjectsApi)
    return {n for a in apis for n in dir(a) if n.startswith(_VERB_PREFIXES)}


def _agent_sources() -> dict[str, str]:
    return {str(f.relative_to(ROOT)): f.read_text() for f in sorted((ROOT / "agent").rglob("*.py"))
            if "testing" not in f.parts}


def _watched() -> set[Grant]:
    from agent.source.watch import KIND_SPECS

    out = set()
    for spec in KIND_SPECS.values():
        group = spec.api_version.rpartition("/")[0]
        resource = spec.path.rstrip("/").rsplit("/", 1)[1]
        out |= {(group, resource, "list"), (group, resource, "watch")}
    return out


def _used() -> set[Grant]:
    out = _watched()
    for _, grants in CALLS.values():
        out |= grants
    return out


def _granted(objs: dict[tuple[str, str], Doc], kinds: tuple[str, ...]) -> set[Grant]:
    out = set()
    for (kind, _), d in objs.items():
        if kind not in kinds:
            continue
        for rule in d["rules"]:
            assert "nonResourceURLs" not in rule
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    out |= {(g, r, v) for v in rule["verbs"]}
    return out


def test_every_api_call_in_agent_is_in_the_table():
    methods = _client_methods()
    found: dict[str, set[str]] = {}
    for path, text in _agent_sources().items():
        for name in set(re.findall(r"\.([a-z_]+)\b", text)) & methods:
            found.setdefault(name, set()).add(path)
        for method in re.findall(r"method=\"([A-Z]+)\"", text):
            assert method == "GET", f"{path}: raw {method} request: add its RBAC and a CALLS row"
    unknown = sorted(set(found) - set(CALLS))
    assert unknown == [], f"agent/ calls {unknown}: grant them in deploy/rbac.yaml, add to CALLS"
    for name, (path, _) in CALLS.items():
        assert path in found.get(name, set()), f"{name} no longer in {path}: update CALLS and RBAC"
    assert WATCH_EVIDENCE[1] in (ROOT / WATCH_EVIDENCE[0]).read_text()


def test_rbac_grants_exactly_what_the_code_uses(objs):
    expected = _used()
    granted = _granted(objs, ("ClusterRole", "Role"))
    assert sorted(granted - expected) == [], "granted but unused"
    assert sorted(expected - granted) == [], "used but not granted"
    for (kind, _), d in objs.items():
        for rule in d.get("rules", []) if kind in ("ClusterRole", "Role") else []:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert all("*" not in x for x in rule.get(field, [])), (kind, rule)


def test_rbac_scoping_and_bindings(objs):
    role = objs[("Role", "aether-agent")]
    assert role["metadata"]["namespace"] == NAMESPACE
    # the DaemonSet read is the only namespaced need, pinned to our own DaemonSet
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["daemonsets"],
                              "resourceNames": ["aether-agent"], "verbs": ["get"]},
                             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["create"]},
                             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "resourceNames": ["aether-gamma-status"], "verbs": ["get", "update"]}]
    assert ("DaemonSet", "aether-agent") in objs
    cluster = _granted({k: v for k, v in objs.items() if k == ("ClusterRole", "aether-agent")},
                       ("ClusterRole",))
    # the main role writes only our own kinds of object: Events, Node taints, EndpointSlices
    assert {(g, r) for g, r, v in cluster if v not in ("get", "list", "watch")} == {
        ("", "events"), ("", "nodes"), ("discovery.k8s.io", "endpointslices"),
        ("aether.io", "meshpods"),
        ("gateway.networking.k8s.io", "httproutes/status"),
        ("gateway.networking.k8s.io", "grpcroutes/status"),
        ("gateway.networking.x-k8s.io", "xmeshes"), ("gateway.networking.x-k8s.io", "xmeshes/status")}
    repair = _granted({k: v for k, v in objs.items() if k == ("ClusterRole", "aether-agent-repair")},
                      ("ClusterRole",))
    assert repair == {("", "pods/eviction", "create"), ("", "pods", "delete")}
    bound = {}
    for (kind, _), d in objs.items():
        if kind in ("ClusterRoleBinding", "RoleBinding"):
            assert d["subjects"] == [{"kind": "ServiceAccount", "name": "aether-agent",
                                      "namespace": NAMESPACE}]
            bound[(d["roleRef"]["kind"], d["roleRef"]["name"])] = kind
    assert bound == {("ClusterRole", "aether-agent"): "ClusterRoleBinding",
                     ("ClusterRole", "aether-agent-repair"): "ClusterRoleBinding",
                     ("Role", "aether-agent"): "RoleBinding"}


def test_meshpod_crd_serves_what_the_agent_reads_and_writes(objs):
    from agent.meshpods import record
    from agent.source.watch import KIND_SPECS

    crd = objs[("CustomResourceDefinition", f"{record.PLURAL}.{record.GROUP}")]["spec"]
    assert (crd["group"], crd["names"]["kind"], crd["names"]["plural"], crd["scope"]) == (
        record.GROUP, record.KIND, record.PLURAL, "Namespaced")
    assert [v["name"] for v in crd["versions"] if v["served"]] == [record.VERSION]
    assert KIND_SPECS[record.KIND].path == f"/apis/{record.API_VERSION}/{record.PLURAL}"
    schema = crd["versions"][0]["schema"]["openAPIV3Schema"]
    pod = schema["properties"]["spec"]["properties"]["pod"]
    assert pod["x-kubernetes-preserve-unknown-fields"] is True  # the slim Pod, kept whole
