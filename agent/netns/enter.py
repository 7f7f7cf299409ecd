"""Run a function inside another network namespace, on a worker thread of its own.

setns(CLONE_NEWNET) changes only the calling thread, so the work runs on a netns worker: a
thread that enters the namespace, does the work and goes back to the agent's own netns,
then proves it is home (its ``/proc/thread-self/ns/net`` is the agent's) before it takes
another job. A worker that cannot go home, or cannot prove it, exits instead: no pooled
thread ever starts a job, and no other agent thread ever runs, in a foreign namespace.
Reusing the thread costs a tenth of starting one (a pod ADD enters its netns twice).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import queue
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
    """Call fn() with a worker's netns set to `path`; re-raise its exception."""
    started = time.monotonic()
    slots = _slots
    if not slots.acquire(timeout=timeout):
        raise TimeoutError(f"{MAX_CONCURRENT} operations in pod namespaces already running "
                           f"for {timeout}s; not entering {path}")
    job = _Job(path, fn, slots)
    try:
        _workers.take().jobs.put(job)
    except BaseException:
        slots.release()
        raise
    if not job.done.wait(max(0.0, timeout - (time.monotonic() - started))):
        raise TimeoutError(f"operation in netns {path} did not finish in {timeout}s")
    if job.error is not None:
        raise job.error
    return job.result  # type: ignore[return-value]


class _Job:
    __slots__ = ("path", "fn", "slots", "result", "error", "done")

    def __init__(self, path: str, fn: Callable[[], object],
                 slots: threading.BoundedSemaphore) -> None:
        self.path, self.fn, self.slots = path, fn, slots
        self.result: object = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        """Enter, work. The worker goes home after it (``_Worker._loop``)."""
        try:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError as e:
                raise NetnsGone(f"netns {self.path} does not exist") from e
            try:
                _setns(fd)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise NetnsError(f"{self.path} is not a network namespace") from e
                raise
            finally:
                os.close(fd)
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            self.error = e

    def finish(self) -> None:
        self.slots.release()  # when the work ends, even after the caller gave up on it
        self.done.set()


class _Home:
    """The agent's own netns: an fd to go back to and the identity to prove it by."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.ident = netns_identity(f"/proc/self/fd/{self.fd}")


_home: _Home | None = None
_home_lock = threading.Lock()


def _home_netns() -> _Home:
    global _home
    with _home_lock:
        if _home is None:
            _home = _Home()
        return _home


def _go_home() -> bool:
    """setns back to the agent's netns; True only when this thread is provably there."""
    try:
        home = _home_netns()
        _setns(home.fd)
        return netns_identity("/proc/thread-self/ns/net") == home.ident
    except Exception:  # noqa: BLE001 - any doubt and the thread is not reused
        return False


class _Worker:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="netns-worker", daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            reused = False
            try:
                job.run()
            finally:
                # home (and proven so) after every job, entered or not, before the pool may
                # hand this thread out again; only then is the caller told the job is done
                try:
                    reused = _go_home() and self.pool.give_back(self)
                finally:
                    job.finish()
            if not reused:
                return  # stranded in a foreign netns, unsure, or not needed: it ends here


class _Pool:
    """Idle workers, at most ``max_idle`` kept; more are started when all are busy."""

    def __init__(self, max_idle: int = 8) -> None:
        self.max_idle = max_idle
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self.started = 0

    def take(self) -> _Worker:
        _home_netns()  # /proc/self/ns/net: the main thread's, which never changes netns
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.started += 1
        return _Worker(self)

    def give_back(self, worker: _Worker) -> bool:
        with self._lock:
            if len(self._idle) >= self.max_idle:
                return False
            self._idle.append(worker)
            return True


_workers = _Pool()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's worker threads: start from an empty pool."""
    global _workers, _slots, _home
    _workers = _Pool()
    _slots = threading.BoundedSemaphore(MAX_CONCURRENT)
    _home = None


os.register_at_fork(after_in_child=_after_fork_in_child)
