"""Keep a pod's netns reachable by path for the pod's whole life.

kubelet/containerd may hand us /proc/<pid>/ns/net, which dies with that process (and could be
reused by another). Envoy opens the path whenever it (re)binds the pod's listener, so the agent
bind-mounts the namespace under its run dir, as `ip netns attach` does, and unpins on DEL.

Envoy may live in another mount namespace than the agent making a pin (an Envoy adopted from
a previous agent whose container or unit had its own). So the pin directory is, like
`ip netns` makes /var/run/netns, a bind mount of itself with shared propagation: a pin mounted
there by any process propagates to every mount namespace whose copy of the directory is in
the same peer group (`share_pin_dir`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2
CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3)

_libc = ctypes.CDLL(None, use_errno=True)
_shared_dirs: set[str] = set()


def needs_pin(path: str) -> bool:
    return path.startswith("/proc/")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source is not None else b"none"
    if _libc.mount(src, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source or ''} {target} (flags {flags:#x}): {os.strerror(err)}")


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, list[str]]]:
    """(mount point, optional fields) of every mount, in mount order."""
    out = []
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 7:
                    continue
                optional = fields[6:fields.index("-")] if "-" in fields else []
                out.append((_unescape(fields[4]), optional))
    except OSError:
        pass
    return out


def mount_entry(path: str, mountinfo: str = "/proc/self/mountinfo") -> list[str] | None:
    """The optional fields (e.g. ``shared:7``, ``master:3``) of the topmost mount at exactly
    `path` in this mount namespace; None when `path` is not a mount point. Unlike
    os.path.ismount this sees a directory bind-mounted onto itself."""
    target = os.path.realpath(path)
    found: list[str] | None = None
    for point, optional in _mounts(mountinfo):
        if point == target:
            found = optional  # later lines are mounted on top: the last one is visible
    return found


def share_pin_dir(directory: str) -> str:
    """Make `directory` a bind mount of itself with shared propagation (once; idempotent).

    Mounts made under it later, by any process, then propagate to every mount namespace
    holding a copy of it in the same peer group: an Envoy started by an earlier agent that
    lived in another mount namespace (created, with propagation kept, from one that had this
    mount) opens the pins a restarted agent makes. Returns the peer group (``shared:N``).
    OSError when the kernel refuses (no CAP_SYS_ADMIN): pins then stay private.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    entry = mount_entry(directory)
    if entry is None:
        inside = os.path.realpath(directory) + "/"
        if any(point.startswith(inside) for point, _ in _mounts()):
            # pins of an earlier agent: a bind over the directory would hide (and leak) them
            raise OSError(errno.EBUSY, f"{directory} holds pins made before it was a shared "
                          "mount; it becomes one at a start when none is left")
        _mount(directory, directory, MS_BIND | MS_REC)
    if entry is None or not any(x.startswith("shared:") for x in entry):
        _mount(None, directory, MS_SHARED | MS_REC)
    entry = mount_entry(directory) or []
    _shared_dirs.add(os.path.realpath(directory))
    return next((x for x in entry if x.startswith("shared:")), "")


def release_pin_dir(directory: str) -> None:
    """Undo share_pin_dir (tests, the demo): detach the directory's self-mount(s) and every
    pin under them. The agent itself never calls this: pins must outlive it."""
    for _ in range(8):
        if mount_entry(directory) is None:
            break
        if _libc.umount2(os.path.realpath(directory).encode(), MNT_DETACH) != 0:
            break
    _shared_dirs.discard(os.path.realpath(directory))


def release_mounts_under(root: str) -> None:
    """Detach every mount at or below `root` (benchmarks' and tests' workdirs before removal)."""
    top = os.path.realpath(root)
    points = [pt for pt, _ in _mounts() if pt == top or pt.startswith(top + "/")]
    for point in reversed(points):  # the last mounted first
        _libc.umount2(point.encode(), MNT_DETACH)
    _shared_dirs.difference_update({d for d in _shared_dirs if d == top or d.startswith(top + "/")})


def pins_visible_to(pid: int, directory: str) -> bool | None:
    """Does a pin this process mounts under `directory` now appear for process `pid` (Envoy)?
    Yes in the same mount namespace; in another one only when its copy of the directory is in
    our peer group or a slave of it. None when that cannot be read."""
    try:
        if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            return True
    except OSError:
        return None
    ours = mount_entry(directory)
    if not os.path.exists(f"/proc/{pid}/mountinfo"):
        return None
    theirs = mount_entry(directory, f"/proc/{pid}/mountinfo")
    if not ours or theirs is None:
        return False
    groups = {x.split(":", 1)[1] for x in ours if x.startswith("shared:")}
    return any(x.split(":", 1)[1] in groups for x in theirs
               if x.startswith(("shared:", "master:")))


def pin(source: str, target: str) -> None:
    directory = os.path.dirname(target)
    if os.path.realpath(directory) not in _shared_dirs:
        try:
            share_pin_dir(directory)
        except OSError:
            os.makedirs(directory, mode=0o700, exist_ok=True)  # a private pin still works here
            _shared_dirs.add(os.path.realpath(directory))
    if os.path.ismount(target):
        return
    with open(target, "a"):
        pass
    if _libc.mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        os.unlink(target)
        raise OSError(err, f"bind-mount {source} → {target}: {os.strerror(err)}")


def unpin(target: str) -> None:
    if os.path.ismount(target) and _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass


def netns_state(path: str) -> str:
    """What `path` is, without ever blocking: ``missing``; ``netns`` (a network namespace:
    an nsfs inode of type net); or ``stale`` — anything else, e.g. the empty file a pin
    leaves once its mount is gone (the agent died between creating and mounting it, or its
    mount namespace went away), a FIFO, a directory. Nothing of ours is reachable through a
    stale path. Only nsfs inodes are opened (a FIFO is never opened)."""
    try:
        st = os.stat(path)
        nsfs_dev = os.stat("/proc/self/ns/net").st_dev
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "missing"
        raise
    if st.st_dev != nsfs_dev or not stat.S_ISREG(st.st_mode):
        return "stale"  # every namespace file lives on the one nsfs device
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        return "netns" if fcntl.ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNET else "stale"
    except OSError:
        return "stale"
    finally:
        os.close(fd)
