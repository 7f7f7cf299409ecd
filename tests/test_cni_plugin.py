"""The kubelet-facing shim: CNI spec behaviour against a fake agent socket (no root)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.cni import request as request_mod
from agent.cni.plugin import run
from agent.cni.request import parse_cni_args, prev_result_ips
from agent.cni.server import UnixJsonServer

PREV = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}],
        "ips": [{"address": "10.1.0.5/24", "interface": 0}, {"address": "fd00::5/64"}]}


@pytest.fixture
def agent() -> Iterator[tuple[str, list[Any]]]:
    d = tempfile.mkdtemp()
    path = os.path.join(d, "cni.sock")
    seen: list[Any] = []

    def verdict(req: Any) -> dict[str, Any]:
        seen.append(req)
        if req.get("netconf", {}).get("fail"):
            return {"ok": False, "code": 101, "msg": "nope", "details": "because"}
        return {"ok": True}

    def handler(data: bytes) -> bytes:
        early, req = request_mod.parse(json.loads(data))
        if early is not None:
            return request_mod.encode(early)
        return request_mod.encode(request_mod.render(req, verdict(req)))

    srv = UnixJsonServer(path, handler)
    srv.start()
    yield path, seen
    srv.stop()


def invoke(command: str, netconf: dict[str, Any] | str, **env: str) -> tuple[int, Any, str]:
    base = {"CNI_COMMAND": command, "CNI_CONTAINERID": "abc123", "CNI_NETNS": "/var/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=app;K8S_POD_NAME=web;K8S_POD_UID=u1"}
    base.update(env)
    out, err = io.StringIO(), io.StringIO()
    stdin = netconf if isinstance(netconf, str) else json.dumps(netconf)
    rc = run(base, stdin, out, err)
    text = out.getvalue()
    return rc, json.loads(text) if text else None, err.getvalue()


def conf(sock: str, **kw: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "k8s", "type": "aether-cni", "agent_socket": sock,
            "prevResult": PREV, **kw}


def test_add_forwards_everything_and_prints_prev_result(agent: tuple[str, list[Any]]) -> None:
    sock, seen = agent
    rc, out, _ = invoke("ADD", conf(sock))
    assert rc == 0 and out == PREV
    req = seen[0]
    assert req["command"] == "ADD" and req["container_id"] == "abc123"
    assert req["netns"] == "/var/run/netns/x" and req["ifname"] == "eth0"
    assert req["args"]["K8S_POD_NAME"] == "web" and req["args"]["K8S_POD_UID"] == "u1"
    assert req["ips"] == ["10.1.0.5", "fd00::5"]
    assert req["netconf"]["agent_socket"] == sock


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0"])
def test_old_versions_accepted(agent: tuple[str, list[Any]], version: str) -> None:
    sock, _ = agent
    prev = {k: v for k, v in PREV.items() if k != "cniVersion"}
    rc, out, _ = invoke("ADD", conf(sock, cniVersion=version, prevResult=prev))
    assert rc == 0 and out["cniVersion"] == version and out["ips"] == PREV["ips"]


def test_add_requires_prev_result(agent: tuple[str, list[Any]]) -> None:
    sock, seen = agent
    c = conf(sock)
    del c["prevResult"]
    rc, out, _ = invoke("ADD", c)
    assert rc == 1 and out["code"] == 7 and "prevResult" in out["msg"]
    assert seen == []


def test_agent_unreachable_fails_add_closed() -> None:
    rc, out, _ = invoke("ADD", conf("/nonexistent/cni.sock"))
    assert rc == 1
    assert out["code"] == 100
    assert out["msg"] == ("aether agent is not reachable at /nonexistent/cni.sock: "
                          "the pod cannot be captured")


def test_agent_timeout_fails_add_closed() -> None:
    import socket
    d = tempfile.mkdtemp()
    path = os.path.join(d, "slow.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(1)  # accepts into the backlog, never answers
    t0 = time.monotonic()
    rc, out, _ = invoke("ADD", conf(path, agent_timeout_seconds=0.5))
    assert rc == 1 and out["code"] == 100 and "not reachable" in out["msg"]
    assert time.monotonic() - t0 < 5
    s.close()


def test_del_succeeds_without_agent() -> None:
    rc, out, err = invoke("DEL", conf("/nonexistent/cni.sock"))
    assert rc == 0 and out is None and "no agent at" in err


def test_del_timeout_is_try_again() -> None:
    import socket
    d = tempfile.mkdtemp()
    path = os.path.join(d, "slow.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(1)  # a live but stuck agent: kubelet must retry DEL, not forget the pod
    rc, out, _ = invoke("DEL", conf(path, agent_timeout_seconds=0.3))
    assert rc == 1 and out["code"] == 11 and "try again" in out["msg"]
    s.close()


def test_agent_error_is_relayed(agent: tuple[str, list[Any]]) -> None:
    sock, _ = agent
    rc, out, _ = invoke("ADD", conf(sock, fail=True))
    assert rc == 1 and out == {"cniVersion": "1.0.0", "code": 101, "msg": "nope",
                               "details": "because"}


def test_check_and_del_print_nothing(agent: tuple[str, list[Any]]) -> None:
    sock, seen = agent
    assert invoke("CHECK", conf(sock))[:2] == (0, None)
    assert invoke("DEL", conf(sock))[:2] == (0, None)
    assert [r["command"] for r in seen] == ["CHECK", "DEL"]


def test_version_and_bad_input(agent: tuple[str, list[Any]]) -> None:
    sock, seen = agent
    rc, out, _ = invoke("VERSION", "")
    assert rc == 0 and "1.0.0" in out["supportedVersions"] and "0.3.1" in out["supportedVersions"]
    rc, out, _ = invoke("ADD", {"cniVersion": "9.9.9", "prevResult": {}, "agent_socket": sock})
    assert rc == 1 and out["code"] == 1
    rc, out, _ = invoke("FROB", {"cniVersion": "1.0.0", "agent_socket": sock})
    assert rc == 1 and out["code"] == 4  # unknown command (STATUS and GC are CNI 1.1's)
    rc, out, _ = invoke("ADD", {"cniVersion": "1.0.0", "prevResult": {}, "agent_socket": sock},
                        CNI_NETNS="")
    assert rc == 1 and out["code"] == 4 and "CNI_NETNS" in out["msg"]
    assert seen == []


def test_undecodable_netconf_reported_by_the_agent(tmp_path: Any) -> None:
    from agent.cni.handler import CniHandler
    from agent.cni.state import StateStore
    from agent.common.config import NodeConfig
    from agent.source.manifests import ManifestSource
    h = CniHandler(NodeConfig(), ManifestSource(str(tmp_path)), StateStore(str(tmp_path / "s")))
    srv = UnixJsonServer(str(tmp_path / "cni.sock"), h.handle_raw)
    srv.start()
    try:
        raw = '{"cniVersion": "1.0.0", "agent_socket": "%s", oops' % (tmp_path / "cni.sock")
        rc, out, _ = invoke("ADD", raw)
        assert rc == 1 and out["code"] == 6 and "valid JSON" in out["msg"]
    finally:
        srv.stop()


def test_helpers_() -> None:
    assert parse_cni_args("IgnoreUnknown=1;A=b;;bad;C=") == {"IgnoreUnknown": "1", "A": "b", "C": ""}
    assert prev_result_ips({"ips": [{"address": "1.2.3.4/32"}, {"nope": 1}, "x"]}) == ["1.2.3.4"]
    assert prev_result_ips(None) == []


def test_shim_imports_stay_light() -> None:
    plugin_dir = os.path.join(os.path.dirname(__file__), "..", "agent", "cni")
    code = (f"import sys; sys.path.insert(0, {plugin_dir!r}); import plugin; "
            "heavy = [m for m in ('grpc', 'kubernetes', 'nftables', 'yaml', 'typer', 'pyroute2', "
            "'json', 'typing', 'socket') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-IS", "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""


@pytest.fixture(params=["python", "native"])
def shim_binary(request: Any, tmp_path: Any) -> str:
    from agent.cni.shim import write_shim
    dest = str(tmp_path / "bin" / "aether-cni")
    kind = write_shim(dest, native=request.param == "native")
    assert kind == request.param, "the native shim needs a C compiler (scripts/setup installs gcc)"
    assert os.stat(dest).st_mode & 0o777 == 0o755
    with open(dest, "rb") as f:
        head = f.read(4)
    if kind == "native":
        assert head == b"\x7fELF"
    else:
        assert head.startswith(b"#!")
    return dest


def run_shim(path: str, command: str, stdin: str, **env: str) -> tuple[int, Any, str]:
    base = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": command, "CNI_CONTAINERID": "abc123",
            "CNI_NETNS": "/var/run/netns/x", "CNI_IFNAME": "eth0",
            "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=app;K8S_POD_NAME=w\"eird"}
    base.update(env)
    p = subprocess.run([path], input=stdin, capture_output=True, text=True, env=base,
                       check=False, timeout=30)
    return p.returncode, json.loads(p.stdout) if p.stdout else None, p.stderr


def test_both_shims_speak_the_same_protocol(shim_binary: str,
                                            agent: tuple[str, list[Any]]) -> None:
    sock, seen = agent
    rc, out, _ = run_shim(shim_binary, "VERSION", "")
    assert rc == 0 and "1.0.0" in out["supportedVersions"]
    rc, out, _ = run_shim(shim_binary, "ADD", json.dumps(conf(sock)))
    assert rc == 0 and out == PREV
    assert seen[-1]["args"]["K8S_POD_NAME"] == 'w"eird' and seen[-1]["ips"][0] == "10.1.0.5"
    rc, out, _ = run_shim(shim_binary, "ADD", json.dumps(conf(sock, fail=True)))
    assert rc == 1 and out["code"] == 101 and out["msg"] == "nope"
    rc, out, _ = run_shim(shim_binary, "CHECK", json.dumps(conf(sock)))
    assert rc == 0 and out is None


def test_both_shims_fail_closed(shim_binary: str, tmp_path: Any) -> None:
    import socket
    rc, out, _ = run_shim(shim_binary, "ADD", json.dumps(conf("/nonexistent/cni.sock",
                                                              cniVersion="0.4.0")))
    assert rc == 1 and out["code"] == 100 and out["cniVersion"] == "0.4.0"
    assert out["msg"] == ("aether agent is not reachable at /nonexistent/cni.sock: "
                          "the pod cannot be captured")
    rc, out, err = run_shim(shim_binary, "DEL", json.dumps(conf("/nonexistent/cni.sock")))
    assert rc == 0 and out is None and "no agent at" in err
    path = str(tmp_path / "stuck.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(1)
    try:
        t0 = time.monotonic()
        rc, out, _ = run_shim(shim_binary, "ADD", json.dumps(conf(path, agent_timeout_seconds=0.5)))
        assert rc == 1 and out["code"] == 100 and "not reachable" in out["msg"]
        assert time.monotonic() - t0 < 5
        rc, out, _ = run_shim(shim_binary, "DEL", json.dumps(conf(path, agent_timeout_seconds=0.3)))
        assert rc == 1 and out["code"] == 11
    finally:
        s.close()


def test_status_and_gc_reach_the_agent_as_cni_1_1_commands() -> None:
    from agent.cni import request as request_mod
    conf = {"cniVersion": "1.1.0", "cni.dev/valid-attachments": [
        {"containerID": "c1", "ifname": "eth0"}]}
    for command in ("STATUS", "GC"):
        early, req = request_mod.parse({"env": {"CNI_COMMAND": command}, "stdin": conf})
        assert early is None and req["command"] == command and req["netconf"] == conf
        assert request_mod.render(req, {"ok": True}) == (0, "")
    answer = request_mod.render({"command": "STATUS", "cni_version": "1.1.0"},
                                {"ok": False, "code": 50, "msg": "not ready"})
    assert answer[0] == 1 and '"code": 50' in answer[1]
