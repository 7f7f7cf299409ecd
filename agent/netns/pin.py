"""Keep a pod's netns reachable by path for the pod's whole life.

kubelet/containerd may hand us /proc/<pid>/ns/net, which dies with that process (and could be
reused by another). Envoy opens the path whenever it (re)binds the pod's listener, so the agent
bind-mounts the namespace under its run dir, as `ip netns attach` does, and unpins on DEL.
"""

from __future__ import annotations

import ctypes
import os

MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def needs_pin(path: str) -> bool:
    return path.startswith("/proc/")


def pin(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
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
