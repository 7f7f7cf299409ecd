"""Run a function inside another network namespace, on a thread of its own.

setns(CLONE_NEWNET) changes only the calling thread, so each call gets a fresh thread that
enters the namespace, does its work and exits; the agent's other threads stay in the host
netns and no pooled thread can leak a foreign namespace.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3)

_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(Exception):
    """The path is not a usable network namespace."""


class NetnsGone(NetnsError):
    """The namespace no longer exists (path missing)."""


def check_netns_path(path: str) -> str:
    """Resolve and validate a netns path: absolute, existing, and really a network namespace."""
    if not path or not os.path.isabs(path):
        raise NetnsError(f"netns path {path!r} is not an absolute path")
    if "\x00" in path:
        raise NetnsError("netns path contains a NUL byte")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise NetnsGone(f"netns {path} does not exist") from e
    except OSError as e:
        raise NetnsError(f"netns {path} cannot be opened: {e.strerror}") from e
    if not stat.S_ISREG(mode):  # nsfs inodes are regular; a FIFO would block open() forever
        raise NetnsError(f"{path} is not a namespace file")
    try:
        # O_NONBLOCK: the path may have been swapped for a FIFO since the stat
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise NetnsGone(f"netns {path} does not exist") from e
    except OSError as e:
        raise NetnsError(f"netns {path} cannot be opened: {e.strerror}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) and not os.path.islink(path):
            # nsfs files report as regular files; a directory or socket is not a namespace
            raise NetnsError(f"{path} is not a namespace file")
        try:
            nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError as e:
            raise NetnsError(f"{path} is not a namespace ({e.strerror})") from e
        if nstype != CLONE_NEWNET:
            raise NetnsError(f"{path} is a namespace but not a network namespace")
    finally:
        os.close(fd)
    return path


NetnsId = tuple[int, int]

#: The namespaces that are the node's own: the agent's (it runs in the host netns) and init's.
HOST_NETNS_PATHS = ("/proc/self/ns/net", "/proc/thread-self/ns/net", "/proc/1/ns/net")


def netns_identity(path: str) -> NetnsId:
    """(st_dev, st_ino) of the namespace behind `path`: the same for /proc/<pid>/ns/net, a
    bind mount of it (a pin, `ip netns add`), and every other path to that one namespace.
    OSError when the path is gone or unreadable."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def host_netns_identities(paths: tuple[str, ...] = HOST_NETNS_PATHS) -> set[NetnsId]:
    """Identities of the node's own namespaces; a path that cannot be read is left out."""
    out: set[NetnsId] = set()
    for p in paths:
        try:
            out.add(netns_identity(p))
        except OSError:
            continue
    return out


def is_host_netns(path: str, host: set[NetnsId] | None = None) -> bool:
    """True when `path` is the agent's or the node's (pid 1's) network namespace.

    A path that cannot be stat'ed is not the host's (callers fail on it anyway)."""
    try:
        ident = netns_identity(path)
    except OSError:
        return False
    return ident in (host_netns_identities() if host is None else host)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# At most this many operations inside pod namespaces at once (each holds the netns fd and,
# for nftables, a netlink socket): with the connection caps of agent/cni/server.py this bounds
# the agent's fd count well below FD_SETSIZE (1024), where libnftables' select() would abort.
MAX_CONCURRENT = 32
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)


def run_in_netns(path: str, fn: Callable[[], T], timeout: float = 30.0) -> T:
    """Call fn() with the current thread's netns set to `path`; re-raise its exception."""
    result: list[T] = []
    error: list[BaseException] = []
    started = time.monotonic()
    if not _slots.acquire(timeout=timeout):
        raise TimeoutError(f"{MAX_CONCURRENT} operations in pod namespaces already running "
                           f"for {timeout}s; not entering {path}")

    def worker() -> None:
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError as e:
                raise NetnsGone(f"netns {path} does not exist") from e
            try:
                _setns(fd)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise NetnsError(f"{path} is not a network namespace") from e
                raise
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            error.append(e)
        finally:
            _slots.release()  # when the work ends, even after the caller gave up on it

    t = threading.Thread(target=worker, name=f"netns:{os.path.basename(path)}", daemon=True)
    try:
        t.start()
    except BaseException:
        _slots.release()
        raise
    t.join(max(0.0, timeout - (time.monotonic() - started)))
    if t.is_alive():
        raise TimeoutError(f"operation in netns {path} did not finish in {timeout}s")
    if error:
        raise error[0]
    return result[0]
