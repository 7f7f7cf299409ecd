"""The pod-netns sysctl an ADD sets: only the kernel's default is changed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.netns.sysctls import reuse_time_wait_here


@pytest.mark.parametrize("before,after", [("2", "1"), ("0", "0"), ("1", "1")])
def test_only_the_kernel_default_is_changed(tmp_path: Path, before: str, after: str) -> None:
    f = tmp_path / "tcp_tw_reuse"
    f.write_text(before + "\n")
    assert reuse_time_wait_here(str(f)) == after  # the value in force is returned …
    assert f.read_text().strip() == after         # … and is what the file holds


def test_an_unwritable_sysctl_is_logged_not_raised(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert reuse_time_wait_here(str(tmp_path / "absent")) is None
    assert "tcp_tw_reuse not set" in caplog.text
