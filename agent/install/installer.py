"""File I/O and the watch loop around the pure conflist transforms.

Once (init container): plugin into the bin dir, entry into kubelet's config, exit. Watch: poll
every `interval` and repair what a primary CNI (or a person) undid, counting repairs so a
fight with an "exclusive" primary CNI is reported instead of silently looping.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.install import conflist as cl
from agent.install import runtime as rt

log = logging.getLogger("aether.install")


@dataclass
class InstallOptions:
    cni_conf_dir: str = "/etc/cni/net.d"
    cni_bin_dir: str = "/opt/cni/bin"
    conflist: str | None = None
    netconf: cl.NetconfOptions = field(default_factory=cl.NetconfOptions)
    python_runtime: str = "copy"
    interval: float = 0.5
    wait_log_every: float = 10.0
    fight_window: float = 60.0
    fight_threshold: int = 3
    verify: bool = True
    # where the agent's `status` reads our repairs (the run dir the agent shares); "" = none
    state_file: str = ""


def read_configs(conf_dir: str) -> dict[str, str]:
    """name → text of every config-looking file in the dir (unreadable ones skipped)."""
    out: dict[str, str] = {}
    try:
        names = os.listdir(conf_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if not cl.is_config_name(name):
            continue
        path = os.path.join(conf_dir, name)
        if not os.path.isfile(path):
            continue
        with contextlib.suppress(OSError, UnicodeDecodeError), open(path) as f:
            out[name] = f.read()
    return out


def write_config(path: str, doc: cl.JSON, mode: int | None = None) -> bool:
    """Atomic write keeping the file's mode; False if the file already says the same."""
    try:
        st = os.stat(path)
        with open(path) as f:
            if cl.parse(f.read()) == doc:
                return False
        keep = st.st_mode & 0o7777
    except (OSError, cl.ConfigError):
        keep = mode if mode is not None else 0o644
    return rt.write_atomic(path, cl.render(doc).encode(), keep)


class Installer:
    """Install, check, repair, uninstall; all state is on disk except the repair counters."""

    def __init__(self, opts: InstallOptions) -> None:
        self.opts = opts
        self.entry = opts.netconf.entry()
        self.repairs = 0
        self.config_repairs = 0
        self.binary_repairs = 0
        self.last_repair: dict[str, object] | None = None
        self._recent: deque[float] = deque()
        self._fight_warned_at = 0.0
        self.current: str | None = None

    # ---- config ---------------------------------------------------------------------------

    def select(self) -> str | None:
        """The file kubelet uses (or `--conflist`), as a name in the conf dir."""
        files = read_configs(self.opts.cni_conf_dir)
        if self.opts.conflist:
            name = os.path.basename(self.opts.conflist)
            return name if name in files else None
        return cl.select_config(files)

    def wait_for_config(self, stop: threading.Event | None = None,
                        timeout: float | None = None) -> str | None:
        """Block until a config exists, saying so periodically; None on stop/timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_said = 0.0
        while True:
            name = self.select()
            if name is not None:
                return name
            now = time.monotonic()
            if now - last_said >= self.opts.wait_log_every:
                what = self.opts.conflist or "a .conf/.conflist/.json file"
                log.info("waiting for the primary CNI to write %s in %s", what,
                         self.opts.cni_conf_dir)
                last_said = now
            if deadline is not None and now >= deadline:
                return None
            if stop is not None:
                if stop.wait(self.opts.interval):
                    return None
            else:
                time.sleep(self.opts.interval)

    def install_config(self, name: str) -> bool:
        """Our entry last in `name` (a `.conf` becomes a `.conflist`); stale copies elsewhere
        are stripped so that Multus delegating to another file never runs us twice."""
        conf_dir = self.opts.cni_conf_dir
        path = os.path.join(conf_dir, name)
        with open(path) as f:
            doc = cl.parse(f.read())
        mode = os.stat(path).st_mode & 0o7777
        target = cl.conflist_name(name, doc)
        changed = write_config(os.path.join(conf_dir, target), cl.insert_entry(doc, self.entry),
                               mode)
        if target != name:
            os.unlink(path)
            log.info("wrapped %s into %s", name, target)
            changed = True
        for other, text in read_configs(conf_dir).items():
            if other == target:
                continue
            with contextlib.suppress(cl.ConfigError):
                odoc = cl.parse(text)
                if cl.contains_entry(odoc):
                    write_config(os.path.join(conf_dir, other), cl.remove_entry(odoc))
                    log.info("removed a stale aether-cni entry from %s", other)
                    changed = True
        if changed:
            log.info("aether-cni entry installed in %s (after %s)", target,
                     cl.primary_type(doc) or "?")
        self.current = target
        return changed

    def config_ok(self) -> tuple[bool, str | None]:
        name = self.select()
        if name is None:
            return False, None
        text = read_configs(self.opts.cni_conf_dir).get(name, "")
        try:
            doc = cl.parse(text)
        except cl.ConfigError:
            return False, name
        return cl.has_entry(doc, self.entry), name

    # ---- plugin ---------------------------------------------------------------------------

    def install_binary(self) -> bool:
        changed, python = rt.install_plugin(self.opts.cni_bin_dir, self.opts.python_runtime)
        shim = os.path.join(self.opts.cni_bin_dir, rt.SHIM_NAME)
        if self.opts.verify:
            versions = rt.verify_shim(shim)
            log.info("%s %s (interpreter %s) answers VERSION: %s", shim,
                     "installed" if changed else "up to date", python, ",".join(versions))
        return changed

    # ---- modes ----------------------------------------------------------------------------

    def install(self, stop: threading.Event | None = None,
                timeout: float | None = None) -> bool:
        """The init-container run: binary first (kubelet must never see an entry it cannot
        exec), then wait for and patch the config. False if stopped before a config came."""
        self.install_binary()
        name = self.wait_for_config(stop, timeout)
        if name is None:
            return False
        self.install_config(name)
        return True

    def write_state(self) -> None:
        """Repairs for `aether-agent status` (best effort: the agent may not share the dir)."""
        if not self.opts.state_file:
            return
        data = {"conflist": self.current, "repairs": self.repairs,
                "config_repairs": self.config_repairs, "binary_repairs": self.binary_repairs,
                "last_repair": self.last_repair, "updated": time.time()}
        try:
            os.makedirs(os.path.dirname(self.opts.state_file) or ".", exist_ok=True)
            tmp = self.opts.state_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.opts.state_file)
        except OSError as e:
            log.debug("cannot write %s: %s", self.opts.state_file, e)

    def check_and_repair(self) -> list[str]:
        """One watch tick: what was repaired (empty when all was in place)."""
        repaired: list[str] = []
        if not rt.plugin_intact(self.opts.cni_bin_dir, self.opts.python_runtime):
            self.install_binary()
            self.binary_repairs += 1
            repaired.append(f"plugin binary in {self.opts.cni_bin_dir}")
        ok, name = self.config_ok()
        if not ok and name is not None:
            moved = self.current is not None and (
                os.path.splitext(self.current)[0] != os.path.splitext(name)[0])
            self.install_config(name)
            if not moved:
                self.config_repairs += 1
                repaired.append(f"entry in {os.path.join(self.opts.cni_conf_dir, name)}")
            else:
                log.info("kubelet's CNI config is now %s (was %s): entry moved", name,
                         self.current)
        if repaired:
            self.repairs += len(repaired)
            self.last_repair = {"time": time.time(), "what": repaired}
            log.warning("repaired %s (repairs so far: %d)", " and ".join(repaired), self.repairs)
            self.write_state()
            if any(r.startswith("entry") for r in repaired):
                self._note_fight(name)
        return repaired

    def _note_fight(self, name: str | None) -> None:
        now = time.monotonic()
        self._recent.append(now)
        while self._recent and now - self._recent[0] > self.opts.fight_window:
            self._recent.popleft()
        if len(self._recent) < self.opts.fight_threshold:
            return
        if now - self._fight_warned_at < self.opts.fight_window:
            return
        self._fight_warned_at = now
        primary = ""
        if name:
            with contextlib.suppress(OSError, cl.ConfigError), \
                    open(os.path.join(self.opts.cni_conf_dir, name)) as f:
                primary = cl.primary_type(cl.parse(f.read()))
        log.warning("the CNI config keeps losing the aether-cni entry (%d repairs in %.0fs): "
                    "another component rewrites it. %s", len(self._recent),
                    self.opts.fight_window, cl.fight_hint(primary))

    def watch(self, stop: threading.Event, on_tick: Callable[[], None] | None = None) -> None:
        """Install, then repair until `stop` is set (poll every interval: repair < 2 s)."""
        if not self.install(stop):
            return
        while not stop.wait(self.opts.interval):
            try:
                self.check_and_repair()
            except (OSError, cl.ConfigError, rt.InstallError) as e:
                log.error("repair failed (will retry): %s", e)
            if on_tick is not None:
                on_tick()

    def uninstall(self) -> list[str]:
        """Our entry out of every config file, our files out of the bin dir."""
        done: list[str] = []
        conf_dir = self.opts.cni_conf_dir
        for name, text in read_configs(conf_dir).items():
            try:
                doc = cl.parse(text)
            except cl.ConfigError:
                continue
            if cl.contains_entry(doc):
                write_config(os.path.join(conf_dir, name), cl.remove_entry(doc))
                done.append(os.path.join(conf_dir, name))
        done += rt.uninstall_plugin(self.opts.cni_bin_dir)
        log.info("uninstalled aether-cni: %s", ", ".join(done) or "nothing to remove")
        return done
