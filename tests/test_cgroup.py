"""The proxy cgroup's pure parts: finding cgroup2, naming it for nft, reading the probe."""

from __future__ import annotations

from agent.netns.cgroup import (
    cgroup2_mount,
    cgroup2_mount_target,
    level_counts,
    nft_name,
    own_cgroup2_path,
    probe_rules,
)

HYBRID = """\
25 30 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
27 25 0:24 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
"""
UNIFIED = "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_ONLY = "27 25 0:24 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
# Under `ip netns exec`: /sys is a fresh sysfs, nothing mounted at /sys/fs/cgroup.
NETNS_EXEC = "40 30 0:50 / /sys rw,relatime - sysfs netns-name rw\n"
CILIUM_ONLY = NETNS_EXEC + "41 30 0:26 / /run/cilium/cgroupv2 rw - cgroup2 none rw\n"


def test_cgroup2_mount_on_hybrid_unified_and_v1_hosts() -> None:
    assert cgroup2_mount(HYBRID) == "/sys/fs/cgroup/unified"
    assert cgroup2_mount(UNIFIED) == "/sys/fs/cgroup"
    assert cgroup2_mount(V1_ONLY) is None


def test_cgroup2_mount_prefers_the_one_nft_can_name() -> None:
    assert cgroup2_mount(CILIUM_ONLY) == "/run/cilium/cgroupv2"  # found, though unnameable
    assert cgroup2_mount(CILIUM_ONLY + HYBRID) == "/sys/fs/cgroup/unified"


def test_mount_target_only_where_nft_sees_no_cgroup2_and_nothing_is_covered() -> None:
    def empty(*free: str):  # type: ignore[no-untyped-def]
        return lambda path: path in free

    every = empty("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
    assert cgroup2_mount_target(UNIFIED, every) is None  # nft sees one already
    assert cgroup2_mount_target(HYBRID, every) is None
    assert cgroup2_mount_target(NETNS_EXEC, every) == "/sys/fs/cgroup"
    assert cgroup2_mount_target(CILIUM_ONLY, every) == "/sys/fs/cgroup"  # cilium's: unnameable
    assert cgroup2_mount_target("", every) == "/sys/fs/cgroup"
    # v1 controllers on a tmpfs at /sys/fs/cgroup: never cover it, use an empty unified/
    v1_tmpfs = "25 30 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n" + V1_ONLY
    assert cgroup2_mount_target(v1_tmpfs, every) == "/sys/fs/cgroup/unified"
    assert cgroup2_mount_target(NETNS_EXEC, empty("/sys/fs/cgroup/unified")) == \
        "/sys/fs/cgroup/unified"
    assert cgroup2_mount_target(NETNS_EXEC, empty()) is None  # neither empty: mount nothing


def test_own_path_is_the_unified_line() -> None:
    text = "4:memory:/x\n0::/system.slice/aether-agent.service\n"
    assert own_cgroup2_path(text) == "/system.slice/aether-agent.service"
    assert own_cgroup2_path("0::/\n") == "/"
    assert own_cgroup2_path("4:memory:/x\n") is None


def test_nft_names_paths_under_sys_fs_cgroup_only() -> None:
    assert nft_name("/sys/fs/cgroup/unified/aether-proxy") == "unified/aether-proxy"
    assert nft_name("/sys/fs/cgroup/system.slice/a.service/aether-proxy") == \
        "system.slice/a.service/aether-proxy"
    assert nft_name("/run/cilium/cgroupv2/aether-proxy") is None  # nft cannot resolve it
    assert nft_name("/sys/fs/cgroup") is None


def test_probe_table_counts_every_level_and_reads_back() -> None:
    text = probe_rules("unified/aether-proxy", max_level=3)
    assert text.count('socket cgroupv2 level') == 3
    assert 'level 3 "unified/aether-proxy" counter' in text
    listing = {"nftables": [
        {"metainfo": {}},
        {"rule": {"comment": "level 1", "expr": [{"counter": {"packets": 2, "bytes": 120}}]}},
        {"rule": {"comment": "level 2", "expr": [{"counter": {"packets": 0, "bytes": 0}}]}},
    ]}
    assert level_counts(listing) == {1: 2, 2: 0}
