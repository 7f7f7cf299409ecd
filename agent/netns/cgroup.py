"""The node proxy's own cgroup (v2): what makes the passthrough-mark RETURN unforgeable.

A pod process with CAP_NET_RAW (every container's default) can set SO_MARK, so a RETURN on
the mark alone lets any pod leave the mesh. Cgroup membership is different: moving a process
needs write access to the host's cgroup files, which a pod does not have. So Envoy runs in a
cgroup of its own, a child of the agent's (``<agent cgroup>/aether-proxy``), and the pod rules
RETURN only sockets that carry the mark *and* were created by a process of that cgroup
(nftables ``socket cgroupv2 level L "<path>"``).

Two host facts make this fiddly, and both are settled by a probe, not by guessing:

* nft resolves the cgroup by path under ``/sys/fs/cgroup`` only. On a unified host that is
  the cgroup2 mount itself; on a hybrid host cgroup2 sits at ``/sys/fs/cgroup/unified`` and
  the path is ``unified/...``. A cgroup2 mount outside ``/sys/fs/cgroup`` cannot be named.
* ``level`` is the cgroup's depth from the real root of the hierarchy, which a process in a
  cgroup namespace (a container) cannot read from ``/proc/self/cgroup``.

Where this process's mount namespace shows no cgroup2 under ``/sys/fs/cgroup`` although the
kernel has cgroup v2 (an agent started under ``ip netns exec``, which remounts ``/sys``
without the cgroup mounts; a container without ``/sys/fs/cgroup``; a hybrid host whose
``unified`` mount lives in another mount namespace), the agent mounts the cgroup2 hierarchy
itself where nft looks (``/sys/fs/cgroup``, else ``/sys/fs/cgroup/unified``), as Cilium
mounts its own at ``/run/cilium/cgroupv2``: only where nothing is mounted and the directory
is empty, so no host mount is ever covered. DEGRADED is left for kernels without cgroup v2.

``setup_proxy_cgroup`` creates the cgroup, then proves the match in a scratch netns: a child
process joins the cgroup and connects out, and the level whose counter moved is the one the
kernel sees. No level moving means the kernel or nft cannot match here: the caller reports the
node degraded (and the rules fall back to the mark alone, loudly).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("aether.cgroup")

NFT_CGROUP_ROOT = "/sys/fs/cgroup"
PROXY_CGROUP_NAME = "aether-proxy"
MAX_PROBE_LEVEL = 24
CLONE_NEWNET = 0x40000000
_PROBE_TABLE = "aether_cgprobe"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RELATIME = 0x2, 0x4, 0x8, 0x200000


@dataclass(frozen=True)
class ProxyCgroup:
    """Where Envoy runs and how the pod rules name it; ``problem`` set when unusable."""

    directory: str | None = None  # absolute path of the cgroup directory
    nft_path: str | None = None  # as nft names it (relative to /sys/fs/cgroup)
    level: int = 0
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.nft_path is not None

    def describe(self) -> str:
        if self.ok:
            return f'socket cgroupv2 level {self.level} "{self.nft_path}"'
        return f"unavailable: {self.problem}"


def _mounts(mountinfo: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every line of /proc/self/mountinfo text (pure)."""
    out = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if sep and len(fields) >= 5:
            out.append((fields[4].replace("\\040", " "), post.split(" ", 1)[0]))
    return out


def cgroup2_mount(mountinfo: str) -> str | None:
    """The mount point of the cgroup2 hierarchy in /proc/self/mountinfo text, one nft can
    name (under /sys/fs/cgroup) first (pure)."""
    points = [point for point, fstype in _mounts(mountinfo) if fstype == "cgroup2"]
    nameable = [p for p in points if p == NFT_CGROUP_ROOT or nft_name(p) is not None]
    found = nameable or points
    return found[0] if found else None


def cgroup2_mount_target(mountinfo: str, empty_dir: Callable[[str], bool]) -> str | None:
    """Where to mount cgroup2 so that nft can name it, when this mount namespace shows none
    under /sys/fs/cgroup: the first of /sys/fs/cgroup and /sys/fs/cgroup/unified that is not
    a mount point and is an empty directory (``empty_dir``), so nothing is ever covered; None
    when there is one already or neither is free (pure)."""
    mounts = _mounts(mountinfo)
    if any(t == "cgroup2" and (p == NFT_CGROUP_ROOT or nft_name(p) is not None)
           for p, t in mounts):
        return None
    points = {p for p, _t in mounts}
    for target in (NFT_CGROUP_ROOT, os.path.join(NFT_CGROUP_ROOT, "unified")):
        if target not in points and empty_dir(target):
            return target
    return None


def _empty_dir(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.listdir(path)
    except OSError:
        return False


def mount_cgroup2(target: str) -> None:
    """Mount the cgroup2 hierarchy at ``target`` in this process's mount namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RELATIME
    if libc.mount(b"cgroup2", target.encode(), b"cgroup2", flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount cgroup2 on {target}: {os.strerror(err)}")


def own_cgroup2_path(proc_cgroup: str) -> str | None:
    """This process's cgroup2 path from /proc/self/cgroup text (the ``0::`` line; pure)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def nft_name(directory: str) -> str | None:
    """How nft names a cgroup directory: relative to /sys/fs/cgroup, or None if outside."""
    rel = os.path.relpath(directory, NFT_CGROUP_ROOT)
    if rel.startswith("..") or rel == "." or '"' in rel:
        return None
    return rel


def probe_rules(nft_path: str, max_level: int = MAX_PROBE_LEVEL) -> str:
    """A scratch table counting TCP SYNs of the cgroup at each level (pure)."""
    rules = "\n".join(
        f'\t\tmeta l4proto tcp socket cgroupv2 level {lvl} "{nft_path}" counter '
        f'comment "level {lvl}"' for lvl in range(1, max_level + 1))
    return (f"table inet {_PROBE_TABLE} {{\n\tchain out {{\n"
            "\t\ttype filter hook output priority 0; policy accept;\n"
            f"{rules}\n\t}}\n}}\n")


def level_counts(listing: dict[str, object]) -> dict[int, int]:
    """Packets counted per probe level, from ``nft -j list table`` output (pure)."""
    out: dict[int, int] = {}
    items = listing.get("nftables", [])
    assert isinstance(items, list)
    for item in items:
        rule = item.get("rule") if isinstance(item, dict) else None
        if not isinstance(rule, dict):
            continue
        comment = str(rule.get("comment", ""))
        for expr in rule.get("expr", []):
            counter = expr.get("counter") if isinstance(expr, dict) else None
            if isinstance(counter, dict) and comment.startswith("level "):
                out[int(comment.split()[1])] = int(counter.get("packets", 0))
    return out


def join(directory: str, pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into the cgroup."""
    with open(os.path.join(directory, "cgroup.procs"), "w") as f:
        f.write(str(pid))


# The probe child: join the cgroup, enter the scratch netns, send one SYN to a closed port.
_CHILD = """
import os, socket, sys, ctypes
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write("0")
fd = os.open(sys.argv[2], os.O_RDONLY)
if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
    sys.exit(3)
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", 9))
except OSError:
    pass
"""


def _probe(directory: str, nft_path: str) -> tuple[list[int], list[int]]:
    """(levels matched by a process in the cgroup, levels matched by the agent itself)."""
    import nftables
    from pyroute2 import IPRoute

    result: list[tuple[list[int], list[int]]] = []
    error: list[BaseException] = []

    def counts(nft: nftables.Nftables) -> dict[int, int]:
        rc, out, err = nft.cmd(f"list table inet {_PROBE_TABLE}")
        if rc != 0:
            raise RuntimeError(err.strip())
        return level_counts(json.loads(out))

    def syn() -> None:
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", 9))
        except OSError:
            pass
        finally:
            s.close()

    def worker() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            with IPRoute() as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            nft = nftables.Nftables()
            nft.set_json_output(True)
            rc, _out, err = nft.cmd(probe_rules(nft_path))
            if rc != 0:
                raise RuntimeError(f"nft cannot match cgroup {nft_path!r}: {err.strip()}")
            syn()  # the agent itself: must match no level of the proxy's cgroup
            agent = counts(nft)
            netns = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net"
            subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD, directory, netns], check=True,
                           timeout=10, capture_output=True)
            after = counts(nft)
            result.append(([lvl for lvl, n in after.items() if n > agent.get(lvl, 0)],
                           [lvl for lvl, n in agent.items() if n > 0]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            error.append(e)

    t = threading.Thread(target=worker, name="cgroup-probe", daemon=True)
    t.start()  # the thread's private netns dies with it
    t.join(30)
    if error:
        raise error[0]
    if not result:
        raise TimeoutError("cgroup probe did not finish in 30s")
    return result[0]


def setup_proxy_cgroup(name: str = PROXY_CGROUP_NAME) -> ProxyCgroup:
    """Create ``<agent cgroup>/<name>`` and prove the nft match on it; never raises."""
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
        with open("/proc/self/cgroup") as f:
            own = own_cgroup2_path(f.read())
        mounted = _mount_where_nft_looks(mountinfo)
        if mounted:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        mount = cgroup2_mount(mountinfo)
    except OSError as e:
        return ProxyCgroup(problem=f"cannot read this process's cgroups: {e}")
    if mount is None or own is None:
        return ProxyCgroup(problem="no cgroup v2 hierarchy is mounted, and none could be "
                                   "mounted (cgroup v1 only)")
    directory = os.path.normpath(os.path.join(mount, own.lstrip("/"), name))
    nft_path = nft_name(directory)
    if nft_path is None:
        return ProxyCgroup(directory, problem=f"cgroup v2 is mounted at {mount}, outside "
                           f"{NFT_CGROUP_ROOT} where nft resolves cgroup paths")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return ProxyCgroup(directory, nft_path, problem=f"cannot create {directory}: {e}")
    try:
        proxy, agent = _probe(directory, nft_path)
    except Exception as e:  # noqa: BLE001 - any failure means: no proven match
        return ProxyCgroup(directory, nft_path, problem=f"cgroup match probe failed: {e}")
    own_levels = [lvl for lvl in proxy if lvl not in agent]
    if not own_levels:
        return ProxyCgroup(directory, nft_path, problem=(
            f"the kernel did not match sockets of {directory} at any level "
            f"(proxy {proxy}, agent {agent})"))
    level = max(own_levels)
    log.info("proxy cgroup %s: pod rules match it as socket cgroupv2 level %d %r",
             directory, level, nft_path)
    return ProxyCgroup(directory, nft_path, level)


def _mount_where_nft_looks(mountinfo: str) -> bool:
    """Mount cgroup2 under /sys/fs/cgroup when this mount namespace shows none there and the
    kernel has it; True when mounted. A failure is logged: the caller reports what it sees."""
    target = cgroup2_mount_target(mountinfo, _empty_dir)
    if target is None:
        return False
    if not _kernel_has_cgroup2():
        return False
    try:
        mount_cgroup2(target)
    except OSError as e:
        log.warning("no cgroup2 under %s in this mount namespace, and mounting one failed: %s",
                    NFT_CGROUP_ROOT, e)
        return False
    log.info("no cgroup2 under %s in this mount namespace (e.g. started under ip netns exec): "
             "mounted the cgroup2 hierarchy at %s for the proxy's cgroup match",
             NFT_CGROUP_ROOT, target)
    return True


def _kernel_has_cgroup2() -> bool:
    try:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1:] == ["cgroup2"] for line in f)
    except OSError:
        return False


def remove_if_empty(directory: str | None) -> None:
    if directory:
        try:
            os.rmdir(directory)
        except OSError:
            pass  # still populated (an Envoy kept for the next agent) or already gone
