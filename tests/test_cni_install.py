"""cni-install on real files: selection, insertion, modes, watch repairs, uninstall, upgrade."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.install import conflist as cl
from agent.install import runtime as rt
from agent.install.cli import exit_action
from agent.install.installer import Installer, InstallOptions
from agent.testing import apiserver
from agent.testing.apiserver import FakeApiServer, Resource

FIX = Path(__file__).parent / "fixtures" / "cni"
DS = Resource("apps", "v1", "daemonsets", "DaemonSet", status=True)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    conf, bin_ = tmp_path / "net.d", tmp_path / "bin"
    conf.mkdir()
    bin_.mkdir()
    return conf, bin_


def make(conf: Path, bin_: Path, **kw: object) -> Installer:
    opts = InstallOptions(cni_conf_dir=str(conf), cni_bin_dir=str(bin_), python_runtime="host",
                          interval=0.1, **kw)  # type: ignore[arg-type]
    return Installer(opts)


def read(path: Path) -> cl.JSON:
    return cl.parse(path.read_text())


@pytest.mark.parametrize("fixture", ["10-flannel.conflist", "10-calico.conflist",
                                     "05-cilium.conflist", "00-multus.conf"])
def test_install_into_primary_configs(dirs: tuple[Path, Path], fixture: str) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / fixture, conf / fixture)
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    target = conf / cl.conflist_name(fixture, read(FIX / fixture))
    doc = read(target)
    assert cl.has_entry(doc, inst.entry)
    assert target.read_text().count('"aether-cni"') == 1
    assert os.access(bin_ / "aether-cni", os.X_OK)
    assert sorted(os.listdir(conf)) == [target.name]


def test_idempotent_and_mode_kept(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    path = conf / "10-calico.conflist"
    shutil.copy(FIX / path.name, path)
    path.chmod(0o600)
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    st = path.stat()
    assert st.st_mode & 0o777 == 0o600
    time.sleep(0.02)
    inst2 = make(conf, bin_)
    assert inst2.install(timeout=1)
    assert not inst2.install_config(path.name), "nothing to change → nothing written"
    st2 = path.stat()
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert not inst2.install_binary()


def test_lone_conf_wrapped_and_mode_kept(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-bridge.conf", conf / "10-bridge.conf")
    (conf / "10-bridge.conf").chmod(0o640)
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    assert sorted(os.listdir(conf)) == ["10-bridge.conflist"]
    assert (conf / "10-bridge.conflist").stat().st_mode & 0o777 == 0o640
    doc = read(conf / "10-bridge.conflist")
    assert [p["type"] for p in doc["plugins"]] == ["bridge", "aether-cni"]


def test_waits_visibly_until_a_config_appears(dirs: tuple[Path, Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    conf, bin_ = dirs
    inst = make(conf, bin_, wait_log_every=0.2)
    timer = threading.Timer(0.6, shutil.copy, (FIX / "10-flannel.conflist",
                                                conf / "10-flannel.conflist"))
    with caplog.at_level(logging.INFO, logger="aether.install"):
        timer.start()
        assert inst.install(timeout=10)
    assert any("waiting for the primary CNI" in r.getMessage() for r in caplog.records)
    assert cl.has_entry(read(conf / "10-flannel.conflist"), inst.entry)


def test_wait_times_out_and_stops(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    inst = make(conf, bin_)
    assert not inst.install(timeout=0.3)
    stop = threading.Event()
    stop.set()
    assert inst.wait_for_config(stop) is None


def test_several_files_first_wins_and_stale_entries_stripped(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    for name in ("10-flannel.conflist", "05-cilium.conflist"):
        shutil.copy(FIX / name, conf / name)
    shutil.copy(FIX / "10-calico-old-aether.conflist", conf / "20-calico.conflist")
    (conf / "notes.txt").write_text("hi")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    assert cl.has_entry(read(conf / "05-cilium.conflist"), inst.entry)
    assert read(conf / "10-flannel.conflist") == read(FIX / "10-flannel.conflist")
    assert not cl.contains_entry(read(conf / "20-calico.conflist"))


def test_conflist_flag_names_the_file(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    for name in ("10-flannel.conflist", "05-cilium.conflist"):
        shutil.copy(FIX / name, conf / name)
    inst = make(conf, bin_, conflist="10-flannel.conflist")
    assert inst.install(timeout=1)
    assert cl.has_entry(read(conf / "10-flannel.conflist"), inst.entry)
    assert not cl.contains_entry(read(conf / "05-cilium.conflist"))


def test_uninstall_removes_entry_and_files(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-calico.conflist", conf / "10-calico.conflist")
    (conf / "10-calico.conflist").chmod(0o600)
    (bin_ / "bridge").write_text("not ours")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    inst.uninstall()
    assert read(conf / "10-calico.conflist") == read(FIX / "10-calico.conflist")
    assert (conf / "10-calico.conflist").stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(bin_)) == ["bridge"]
    assert inst.uninstall() == []


def test_repair_counts_and_warns_on_a_fight(dirs: tuple[Path, Path],
                                            caplog: pytest.LogCaptureFixture) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "05-cilium.conflist", conf / "05-cilium.conflist")
    inst = make(conf, bin_, fight_threshold=3)
    assert inst.install(timeout=1)
    assert inst.check_and_repair() == []
    with caplog.at_level(logging.WARNING, logger="aether.install"):
        for _ in range(3):
            shutil.copy(FIX / "05-cilium.conflist", conf / "05-cilium.conflist")
            assert len(inst.check_and_repair()) == 1
    assert inst.config_repairs == 3 and inst.repairs == 3
    assert any("cni.exclusive" in r.getMessage() for r in caplog.records)
    (bin_ / "aether-cni").unlink()
    assert inst.check_and_repair() == [f"plugin binary in {bin_}"]
    assert inst.binary_repairs == 1


def test_rewritten_conf_beside_our_conflist_is_a_repair(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-bridge.conf", conf / "10-bridge.conf")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    shutil.copy(FIX / "10-bridge.conf", conf / "10-bridge.conf")  # the primary rewrites its file
    assert len(inst.check_and_repair()) == 1
    assert sorted(os.listdir(conf)) == ["10-bridge.conflist"]


def test_kubelet_choice_moves_entry_follows(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-calico.conflist", conf / "10-calico.conflist")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    shutil.copy(FIX / "00-multus.conf", conf / "00-multus.conf")
    inst.check_and_repair()
    assert cl.has_entry(read(conf / "00-multus.conflist"), inst.entry)
    assert not cl.contains_entry(read(conf / "10-calico.conflist"))


def test_copied_runtime_runs_the_shim(tmp_path: Path) -> None:
    """The fast half of the runtime check (the masked-prefix half is an integration test)."""
    bin_ = tmp_path / "bin"
    changed, python = rt.install_plugin(str(bin_), "copy")
    assert changed and python == str(bin_ / "aether" / "runtime" / "bin" / "python3")
    shim = (bin_ / "aether-cni").read_text()
    assert shim.startswith(f"#!{python} -IS\n") or shim.startswith("#!/bin/sh\n")
    assert "1.0.0" in rt.verify_shim(str(bin_ / "aether-cni"))
    assert rt.plugin_intact(str(bin_), "copy")
    assert not (bin_ / "aether" / "runtime" / "lib" / "python3.11" / "site-packages").exists()
    assert rt.install_plugin(str(bin_), "copy")[0] is False
    (bin_ / "aether" / "runtime" / "lib" / "python3.11" / "socket.py").unlink()
    assert not rt.plugin_intact(str(bin_), "copy")


def test_shim_is_self_contained() -> None:
    src = rt.plugin_source()
    assert "from agent" not in src and "import agent" not in src
    compile(src, "aether-cni", "exec")


# ---- watch mode, as a separate process, against another process rewriting files ---------

def _spawn_watch(conf: Path, bin_: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "agent.install.cli", "--cni-conf-dir", str(conf),
           "--cni-bin-dir", str(bin_), "--watch", "--python-runtime", "host",
           "--log-format", "json", "--capture-redirect-all-default", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(cond: object, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def _has_entry(path: Path) -> bool:
    try:
        return cl.has_entry(read(path))
    except (OSError, cl.ConfigError):
        return False


@pytest.fixture
def watcher(dirs: tuple[Path, Path]) -> Iterator[tuple[Path, Path, subprocess.Popen[str]]]:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-flannel.conflist", conf / "10-flannel.conflist")
    proc = _spawn_watch(conf, bin_, "--daemonset-name", "")
    yield conf, bin_, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_watch_repairs_overwrite_and_deleted_binary(
        watcher: tuple[Path, Path, subprocess.Popen[str]]) -> None:
    conf, bin_, proc = watcher
    path = conf / "10-flannel.conflist"
    _wait(lambda: _has_entry(path) and (bin_ / "aether-cni").exists(), 20)
    assert read(path)["plugins"][-1]["capture_redirect_all_default"] is True
    # another process (the primary CNI's installer) writes its config back
    subprocess.run([sys.executable, "-c", "import shutil,sys; shutil.copy(sys.argv[1], "
                    "sys.argv[2])", str(FIX / path.name), str(path)], check=True)
    assert not _has_entry(path)
    assert _wait(lambda: _has_entry(path), 2.0) <= 2.0
    (bin_ / "aether-cni").unlink()
    assert _wait(lambda: os.access(bin_ / "aether-cni", os.X_OK), 2.0) <= 2.0
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    msgs = [json.loads(line)["msg"] for line in out.splitlines() if line.startswith("{")]
    assert any("repaired entry in" in m for m in msgs), out
    assert any("repaired plugin binary" in m for m in msgs), out
    # no DaemonSet configured: exit means removal
    assert read(path) == read(FIX / path.name)
    assert not (bin_ / "aether-cni").exists()


def test_cli_once_and_uninstall(dirs: tuple[Path, Path]) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-bridge.conf", conf / "10-bridge.conf")
    base = [sys.executable, "-m", "agent.install.cli", "--cni-conf-dir", str(conf),
            "--cni-bin-dir", str(bin_), "--python-runtime", "host"]
    subprocess.run(base + ["--agent-socket", "/x/cni.sock"], check=True, timeout=60)
    doc = read(conf / "10-bridge.conflist")
    assert doc["plugins"][-1] == {"type": "aether-cni", "agent_socket": "/x/cni.sock",
                                  "capture_redirect_all_default": False, "log_level": "info"}
    subprocess.run(base + ["--uninstall"], check=True, timeout=60)
    assert [p["type"] for p in read(conf / "10-bridge.conflist")["plugins"]] == ["bridge"]
    assert os.listdir(bin_) == []


# ---- upgrade vs removal ------------------------------------------------------------------

@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[FakeApiServer, str]]:
    if DS not in apiserver.RESOURCES:
        monkeypatch.setattr(apiserver, "RESOURCES", (*apiserver.RESOURCES, DS))
    with FakeApiServer() as server:
        yield server, server.kubeconfig(tmp_path / "kubeconfig")


def _ds(deleting: bool = False) -> cl.JSON:
    meta: cl.JSON = {"name": "aether-agent", "namespace": "aether-system"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta, "spec": {}}


@pytest.mark.parametrize(("present", "deleting", "expect"), [
    (True, False, "kept"), (True, True, "uninstalled"), (False, False, "uninstalled")])
def test_exit_keeps_entry_during_upgrade(dirs: tuple[Path, Path], api: tuple[FakeApiServer, str],
                                         present: bool, deleting: bool, expect: str) -> None:
    conf, bin_ = dirs
    server, kubeconfig = api
    if present:
        server.put_object(_ds(deleting))
    shutil.copy(FIX / "10-calico.conflist", conf / "10-calico.conflist")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    assert exit_action(inst, "aether-agent", "aether-system", kubeconfig) == expect
    kept = expect == "kept"
    assert cl.has_entry(read(conf / "10-calico.conflist")) is kept
    assert (bin_ / "aether-cni").exists() is kept


def test_exit_keeps_entry_when_api_unreachable(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    conf, bin_ = dirs
    shutil.copy(FIX / "10-calico.conflist", conf / "10-calico.conflist")
    inst = make(conf, bin_)
    assert inst.install(timeout=1)
    server = FakeApiServer().start()
    kubeconfig = server.kubeconfig(tmp_path / "kc")
    server.stop()
    assert exit_action(inst, "aether-agent", "aether-system", kubeconfig) == "kept"


def test_watch_sigterm_during_upgrade_keeps_entry(
        dirs: tuple[Path, Path], api: tuple[FakeApiServer, str]) -> None:
    conf, bin_ = dirs
    server, kubeconfig = api
    server.put_object(_ds())
    shutil.copy(FIX / "10-flannel.conflist", conf / "10-flannel.conflist")
    # the subprocess has its own (unpatched) test server table: exit_action is what we check,
    # so run the watcher in-process and stop it like SIGTERM does
    inst = make(conf, bin_)
    stop = threading.Event()
    t = threading.Thread(target=inst.watch, args=(stop,))
    t.start()
    _wait(lambda: _has_entry(conf / "10-flannel.conflist"), 10)
    stop.set()
    t.join(10)
    assert exit_action(inst, "aether-agent", "aether-system", kubeconfig) == "kept"
    assert _has_entry(conf / "10-flannel.conflist")


def test_native_shim_install_and_repair_check(tmp_path: Path) -> None:
    """--python-runtime native: one self-contained binary in the bin dir, nothing else."""
    from agent.install import runtime as rt
    bin_dir = str(tmp_path / "bin")
    changed, _ = rt.install_plugin(bin_dir, "native")
    assert changed and rt.plugin_intact(bin_dir, "native")
    assert sorted(os.listdir(bin_dir)) == ["aether-cni"]
    assert not rt.install_plugin(bin_dir, "native")[0]  # idempotent: nothing rewritten
    assert "1.0.0" in rt.verify_shim(os.path.join(bin_dir, "aether-cni"))
    with open(os.path.join(bin_dir, "aether-cni"), "wb") as f:
        f.write(b"tampered")
    assert not rt.plugin_intact(bin_dir, "native")


def test_repairs_recorded_for_agent_status(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    conf, bin_ = dirs
    state = tmp_path / "run" / "cni-install.json"
    shutil.copy(FIX / "05-cilium.conflist", conf / "05-cilium.conflist")
    inst = make(conf, bin_, state_file=str(state))
    assert inst.install(timeout=1)
    shutil.copy(FIX / "05-cilium.conflist", conf / "05-cilium.conflist")
    assert len(inst.check_and_repair()) == 1
    data = json.loads(state.read_text())
    assert data["repairs"] == 1 and data["conflist"] == "05-cilium.conflist"
    assert data["last_repair"]["what"][0].startswith("entry in ")


def test_auto_runtime_prefers_the_native_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cni-install` run by hand gets the fast path wherever the shim can be built."""
    import agent.cni.shim as shim
    from agent.install.cli import resolve_runtime

    monkeypatch.setattr(shim, "native_binary", lambda: "/tmp/aether-cni-native")
    assert resolve_runtime("auto") == "native"
    monkeypatch.setattr(shim, "native_binary", lambda: None)
    assert resolve_runtime("auto") == "copy"
    assert resolve_runtime("host") == "host"  # an explicit choice is kept
