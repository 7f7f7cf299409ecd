"""Program, read and remove the aether table inside a pod netns through libnftables.

No `nft` subprocess: a libnftables context is created inside the target netns (its netlink
socket binds to the namespace of the thread that opens it) and the whole ruleset goes in as
one transaction.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import nftables

from agent.capture.rules import TABLE_FAMILY, TABLE_NAME, fingerprint, render_delete
from agent.netns.enter import run_in_netns

T = TypeVar("T")


class NftError(Exception):
    pass


class _LoadOnce:
    """The binding's ``Nftables()`` dlopens libnftables and wraps its functions again for
    every context: GIL-held work that was an eighth of the agent's CPU under 16 concurrent
    ADDs (each ADD makes two or three contexts). Handing it the one loaded library keeps a
    fresh context per operation (its netlink socket opens in the thread's netns, which is
    why contexts are never shared) without the reload."""

    def __init__(self) -> None:
        self._libs: dict[str, ctypes.CDLL] = {}
        self._lock = threading.Lock()

    def LoadLibrary(self, name: str) -> ctypes.CDLL:  # noqa: N802 - ctypes.LibraryLoader's
        with self._lock:
            lib = self._libs.get(name)
            if lib is None:
                lib = self._libs[name] = ctypes.CDLL(name)
            return lib


nftables.cdll = _LoadOnce()  # the module global its Nftables.__init__ loads through


# libnftables select()s on its netlink socket: an fd number >= FD_SETSIZE (1024) aborts the
# whole process inside glibc. A new socket takes the lowest free fd, which is below the count
# of open fds; the servers' connection caps keep that count far below this guard, and the
# guard turns any surprise into a failed (retried) operation instead of a dead agent.
FD_SETSIZE = 1024
FD_HEADROOM = 64


def lowest_free_fd() -> int:
    """The fd number the next socket would get (the lowest free one): what libnftables'
    netlink socket will be, which select() needs below FD_SETSIZE. Two syscalls, where
    counting /proc/self/fd walked every open fd on each of an ADD's libnftables calls."""
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return fd


def _ctx() -> nftables.Nftables:
    n = lowest_free_fd()
    if n >= FD_SETSIZE - FD_HEADROOM:
        raise NftError(f"the lowest free fd in the agent is {n}: libnftables needs one below "
                       f"{FD_SETSIZE} (select()); refusing rather than aborting")
    nft = nftables.Nftables()
    nft.set_json_output(False)
    return nft


def _run(script: str) -> str:
    nft = _ctx()
    rc, out, err = nft.cmd(script)
    if rc != 0:
        raise NftError(err.strip() or f"libnftables returned {rc}")
    return str(out)


def _list_json() -> dict[str, Any] | None:
    nft = _ctx()
    nft.set_json_output(True)
    rc, out, err = nft.cmd(f"list table {TABLE_FAMILY} {TABLE_NAME}")
    if rc != 0:
        if "No such file" in err or "does not exist" in err:
            return None
        raise NftError(err.strip())
    data: dict[str, Any] = json.loads(out)
    return data


class _CreatedFingerprints:
    """Fingerprints of tables made by a plain `create table` script, by script text.

    A `create` that succeeds made the table from nothing: the kernel holds exactly that
    script, so its listing — and fingerprint — is the same in every netns it went into. The
    first ADD of each distinct ruleset reads the table back; later ones reuse it and skip a
    libnftables context and a listing (half of the apply's CPU). A replace (the table was
    there) is always read back: what it replaced is not known."""

    def __init__(self, limit: int = 256) -> None:
        self._fps: dict[str, str] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, script: str) -> str | None:
        with self._lock:
            return self._fps.get(script)

    def put(self, script: str, fp: str) -> None:
        with self._lock:
            if len(self._fps) >= self._limit:
                self._fps.pop(next(iter(self._fps)))
            self._fps[script] = fp


created_fingerprints = _CreatedFingerprints()


def _apply_here(script: str, first: str | None) -> str:
    """Apply in the calling thread's netns; the fingerprint of what the kernel now holds."""
    if first is None:
        _run(script)
    else:
        try:
            _run(first)
        except NftError as e:
            if "File exists" not in str(e):
                raise
            _run(script)
        else:
            known = created_fingerprints.get(first)
            if known is not None:
                return known
            listing = _list_json()
            if listing is None:
                raise NftError("table missing right after it was programmed")
            fp = fingerprint(listing)
            created_fingerprints.put(first, fp)
            return fp
    listing = _list_json()
    if listing is None:
        raise NftError("table missing right after it was programmed")
    return fingerprint(listing)


def apply_ruleset(netns: str, script: str, first: str | None = None) -> str:
    """Apply atomically and return the fingerprint of what the kernel now holds. ``first``:
    a cheaper transaction to try before ``script`` (a plain `create table`, which fails when
    the table exists; then ``script``, the replace form, applies)."""
    return run_in_netns(netns, lambda: _apply_here(script, first))


def apply_ruleset_and(netns: str, script: str, first: str | None,
                      then: Callable[[], T]) -> tuple[str, T]:
    """``apply_ruleset``, then ``then()`` in the same visit to the netns (once the rules are
    in): an ADD's second question of the pod's netns costs no second entry."""
    def work() -> tuple[str, T]:
        fp = _apply_here(script, first)
        return fp, then()

    return run_in_netns(netns, work)


def delete_table(netns: str) -> bool:
    """Remove the aether table; False when there was none."""

    def work() -> bool:
        if _list_json() is None:
            return False
        _run(render_delete())
        return True

    return run_in_netns(netns, work)


def live_fingerprint(netns: str) -> str | None:
    def work() -> str | None:
        listing = _list_json()
        return None if listing is None else fingerprint(listing)

    return run_in_netns(netns, work)


def list_table_text(netns: str) -> str | None:
    def work() -> str | None:
        nft = _ctx()
        rc, out, err = nft.cmd(f"list table {TABLE_FAMILY} {TABLE_NAME}")
        return str(out) if rc == 0 else None

    return run_in_netns(netns, work)
