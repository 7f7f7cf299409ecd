"""The memory census tool (bench.agent_census) counts what a process holds."""

from __future__ import annotations

import os

from bench.agent_census import DONE, _shape, census


def test_shapes_fold_digits_so_per_object_strings_group() -> None:
    assert _shape("ns-07/svc-00123") == repr("ns-99/svc-99999")
    assert _shape(b"svc|ns-01|80") == repr(b"svc|ns-99|99")


def test_the_census_finds_what_this_process_holds(tmp_path: os.PathLike[str]) -> None:
    held = [{"key": f"pod-{i:06d}-" + "m" * 1000} for i in range(2000)]  # ~2 MB of strings
    census(str(tmp_path))
    with open(os.path.join(tmp_path, "census.txt")) as f:
        text = f.read()
    assert "dict" in text.split("untracked")[1]  # the 2000 dicts, untracked (atomic values)
    assert repr("pod-999999-" + "m" * 29) in text  # their strings, grouped by shape
    with open(os.path.join(tmp_path, "mallocstats.txt")) as f:
        assert "arenas" in f.read()
    assert os.path.exists(os.path.join(tmp_path, DONE))
    assert len(held) == 2000
