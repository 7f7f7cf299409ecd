"""The capture dataplane: everything the pod lifecycle (ADD, DEL, CHECK, GC, live enrollment,
reconcile at start, the undo of an interrupted ADD, uninstall) does to a pod's network
namespace, behind one small interface.

The CNI handler and the agent's reconciler receive a ``CaptureDataplane`` by construction;
production passes ``NftDataplane`` (libnftables in the pod's netns, bind-mount pins), and the
unit tests a fake, so ADD's success and every rollback branch are tested without root.
"""

from __future__ import annotations

from typing import Protocol

from agent.netns import nft
from agent.netns.enter import (
    NetnsError,
    NetnsId,
    check_netns_path,
    host_netns_identities,
    netns_identity,
)
from agent.netns.families import families_here
from agent.netns.pin import needs_pin, netns_state, pin, unpin
from agent.netns.sysctls import migrate_requests_here, reuse_time_wait_here

# What a dataplane call raises when the netns or its rules are not as expected: one tuple,
# caught wherever a failure must become a CNI error, a log line or a repair.
DATAPLANE_ERRORS: tuple[type[BaseException], ...] = (nft.NftError, NetnsError, OSError,
                                                     TimeoutError)


class CaptureDataplane(Protocol):
    """A pod netns as the capture lifecycle sees it."""

    def check_netns(self, path: str) -> None:
        """Raise NetnsError (or OSError) unless ``path`` is a network namespace."""

    def identity(self, path: str) -> NetnsId:
        """The namespace's identity (device, inode): the same netns by any path."""

    def host_identities(self) -> set[NetnsId]:
        """The node's own namespaces (the agent's, pid 1's): never captured."""

    def needs_pin(self, path: str) -> bool:
        """Whether ``path`` dies with a process (``/proc/<pid>/ns/net``) and needs a pin."""

    def pin(self, source: str, target: str) -> None: ...

    def unpin(self, target: str) -> None: ...

    def is_stale_pin(self, path: str) -> bool:
        """A pin whose mount is gone (an empty file): not a netns any more."""

    def netns_state(self, path: str) -> str:
        """``netns``, ``stale`` (a path that is no namespace, e.g. a pin whose mount is gone)
        or ``missing`` — without ever blocking (``agent.netns.pin.netns_state``)."""

    def apply(self, netns: str, ruleset: str, first: str | None = None) -> str:
        """Apply the capture table atomically; the fingerprint of what the kernel holds."""

    def capture(self, netns: str, ruleset: str, first: str | None = None
                ) -> tuple[str, tuple[bool, bool]]:
        """``apply``, and which loopback families bind there (127.0.0.1, ::1), in one visit:
        the two questions an ADD asks of the pod's netns."""

    def drop(self, netns: str) -> bool:
        """Remove the capture table; False when there was none."""

    def live_fingerprint(self, netns: str) -> str | None: ...

    def listing(self, netns: str) -> str | None:
        """The capture table as nft prints it (status, debugging)."""


class NftDataplane:
    """The real one: libnftables inside the pod's netns, bind-mount pins under the run dir."""

    def check_netns(self, path: str) -> None:
        check_netns_path(path)

    def identity(self, path: str) -> NetnsId:
        return netns_identity(path)

    def host_identities(self) -> set[NetnsId]:
        return set(host_netns_identities())

    def needs_pin(self, path: str) -> bool:
        return needs_pin(path)

    def pin(self, source: str, target: str) -> None:
        pin(source, target)

    def unpin(self, target: str) -> None:
        unpin(target)

    def is_stale_pin(self, path: str) -> bool:
        return netns_state(path) == "stale"

    def netns_state(self, path: str) -> str:
        return netns_state(path)

    def apply(self, netns: str, ruleset: str, first: str | None = None) -> str:
        # a re-programmed pod (a take-over's included) gets the queue migration too
        return nft.apply_ruleset_and(netns, ruleset, first, migrate_requests_here)[0]

    def capture(self, netns: str, ruleset: str, first: str | None = None
                ) -> tuple[str, tuple[bool, bool]]:
        return nft.apply_ruleset_and(netns, ruleset, first, _after_rules_here)

    def drop(self, netns: str) -> bool:
        return nft.delete_table(netns)

    def live_fingerprint(self, netns: str) -> str | None:
        return nft.live_fingerprint(netns)

    def listing(self, netns: str) -> str | None:
        return nft.list_table_text(netns)


def _after_rules_here() -> tuple[bool, bool]:
    """An ADD's work in the pod's netns once the rules are in: the TIME_WAIT sysctl (see
    ``agent.netns.sysctls``), then the loopback families the capture listener may bind."""
    reuse_time_wait_here()
    migrate_requests_here()  # a later take-over closes listeners here: no queued connection reset
    return families_here()
