"""Diagnostic: where the real agent's memory goes at cluster scale (not a benchmark row).

    python -m bench.agent_census [--pods 100000] [--services 10000] [--out DIR]

Runs one size of ``bench.agent_scale`` (the test API server, the real ``aether-agent run``
with its Envoy) with the agent started through this module, which installs SIGUSR1 and
SIGUSR2 handlers; once the agent is ready it is signalled and writes, into ``--out``:

- ``trim.txt`` (SIGUSR1, first): the RSS before and after ``malloc_trim(0)``, i.e. what glibc
  held freed but not returned; ``malloc_info.xml``: glibc's arenas just before it;

- ``census.txt``: gc-tracked objects by type (count, ``sys.getsizeof`` total), then the
  untracked ones reachable from them (strings, bytes, atomic-only dicts and tuples), then the
  string and bytes "shapes" (digits folded to 9) holding the most memory: a string held once
  per endpoint instead of once per identity shows up as a shape far bigger than its count;
  and the dict shapes (length, first keys; untracked ones by what they were reached from);
- ``indexes.txt``: the long-lived holders' big dicts (entries, size, value shapes);
- ``owners.txt``: the deep size of each holder's attributes, the store's by kind last;
- ``mallocstats.txt``: ``sys._debugmallocstats()`` (pymalloc's arenas and blocks in use).

What it found is in ``bench/README.md`` (the session notes).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import os
import re
import runpy
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from typing import Any

import psutil

DONE = "census.done"


def _shape(value: str | bytes) -> str:
    if isinstance(value, bytes):
        return repr(re.sub(rb"[0-9]", b"9", value[:40]))
    return repr(re.sub(r"[0-9]", "9", value[:40]))


def _dict_shape(d: dict[Any, Any]) -> str:
    """A dict's length and first keys, digits folded (``{}`` for the empty one)."""
    keys = sorted(re.sub(r"[0-9]", "9", str(k))[:20] for k in list(d)[:50])[:4]
    return f"len {len(d)} {keys}"


def _tuple_shape(t: tuple[Any, ...]) -> str:
    """A tuple's length and its first items' types (and the first item, digits folded)."""
    head = re.sub(r"[0-9]", "9", repr(t[0])[:24]) if t else ""
    return f"len {len(t)} ({', '.join(type(x).__name__ for x in t[:3])}) {head}"


def census(out: str) -> None:
    """Write the census files into ``out`` (runs in the agent, on its main thread)."""
    gc.collect()
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    usize: collections.Counter[str] = collections.Counter()
    ucount: collections.Counter[str] = collections.Counter()
    shapes: dict[str, collections.Counter[str]] = {"str": collections.Counter(),
                                                    "bytes": collections.Counter()}
    dicts: collections.Counter[str] = collections.Counter()
    ndicts: collections.Counter[str] = collections.Counter()
    tuples: collections.Counter[str] = collections.Counter()
    ntuples: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    for obj in gc.get_objects():
        name = type(obj).__name__
        count[name] += 1
        size[name] += sys.getsizeof(obj)
        if isinstance(obj, dict):
            shape = f"tracked {_dict_shape(obj)}"
            dicts[shape] += sys.getsizeof(obj)
            ndicts[shape] += 1
        elif isinstance(obj, tuple):
            shape = f"tracked {_tuple_shape(obj)}"
            tuples[shape] += sys.getsizeof(obj)
            ntuples[shape] += 1
        # untracked objects (strings, and dicts/tuples holding only atomic values, which
        # gc stops tracking) reachable from it, through untracked containers too
        stack = list(gc.get_referents(obj))
        while stack:
            ref = stack.pop()
            if gc.is_tracked(ref) or id(ref) in seen:
                continue
            seen.add(id(ref))
            rname = type(ref).__name__
            n = sys.getsizeof(ref)
            usize[rname] += n
            ucount[rname] += 1
            if isinstance(ref, (str, bytes)):
                shapes[rname][_shape(ref)] += n
            elif isinstance(ref, dict):
                shape = f"in a {name}: {_dict_shape(ref)}"
                dicts[shape] += n
                ndicts[shape] += 1
                stack.extend(gc.get_referents(ref))
            elif isinstance(ref, tuple):
                shape = f"in a {name}: {_tuple_shape(ref)}"
                tuples[shape] += n
                ntuples[shape] += 1
                stack.extend(gc.get_referents(ref))
    with open(os.path.join(out, "census.txt"), "w") as f:
        f.write("gc-tracked objects: type, count, MB\n")
        for name, n in size.most_common(30):
            f.write(f"{name:32s} {count[name]:9d} {n / 2**20:8.1f}\n")
        f.write("\nuntracked objects reachable from them\n")
        for name, n in usize.most_common(10):
            f.write(f"{name:32s} {ucount[name]:9d} {n / 2**20:8.1f}\n")
        for kind, by_shape in shapes.items():
            f.write(f"\n{kind} shapes holding the most (MB)\n")
            for shape, n in by_shape.most_common(20):
                f.write(f"{n / 2**20:8.1f}  {shape}\n")
        f.write("\ndict shapes holding the most (MB, count; untracked ones by the type of the "
                "tracked object they were reached from)\n")
        for shape, n in dicts.most_common(25):
            f.write(f"{n / 2**20:8.1f} {ndicts[shape]:8d}  {shape}\n")
        f.write("\ntuple shapes holding the most (MB, count; as dicts above)\n")
        for shape, n in tuples.most_common(25):
            f.write(f"{n / 2**20:8.1f} {ntuples[shape]:8d}  {shape}\n")
    holders = _holders()
    with open(os.path.join(out, "indexes.txt"), "w") as f:
        f.write("dict attributes of the holders: entries, the dict itself (MB), its values "
                "shallow (MB), value types\n")
        for line in _indexes(holders):
            f.write(line + "\n")
    with open(os.path.join(out, "owners.txt"), "w") as f:
        f.write("deep size by holder (class.attribute, MB; an object counted once, first "
                "holder in this order wins)\n")
        for where, n in _owners(holders):
            f.write(f"{n / 2**20:8.1f}  {where}\n")
    fd = os.open(os.path.join(out, "mallocstats.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)
    open(os.path.join(out, DONE), "w").close()  # noqa: SIM115 - a marker


#: The agent's long-lived holders, largest first in the usual census: their attributes are
#: sized in this order.
HOLDERS = ("Registry", "MeshModel", "ResourceBuilder", "XdsServer", "KubeSource",
           "CachedSource", "EnrollmentLoop", "MeshRuntime",
           "MeshPodPublisher", "ObjectStore")
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, types.CodeType)


def _deep(root: object, seen: set[int]) -> int:
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, (str, bytes, int, float)):
            continue
        if type(obj).__name__ in HOLDERS or isinstance(obj, threading.Thread):
            continue  # another holder: sized on its own
        stack.extend(gc.get_referents(obj))
    return total


def _holders() -> list[object]:
    """The live holders, in ``HOLDERS`` order."""
    objs = [o for o in gc.get_objects() if type(o).__name__ in HOLDERS]
    objs.sort(key=lambda o: HOLDERS.index(type(o).__name__))
    return objs


def _owners(holders: list[object]) -> list[tuple[str, int]]:
    seen: set[int] = set()
    out: list[tuple[str, int]] = []
    for obj in holders:
        if type(obj).__name__ == "ObjectStore":
            out.extend(_kinds_breakdown(obj, seen))
        seen.add(id(obj))
        attrs = dict(getattr(obj, "__dict__", {}))
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
        for name, value in attrs.items():
            out.append((f"{type(obj).__name__}.{name}", _deep(value, seen)))
    out.sort(key=lambda x: -x[1])
    return out[:40]


def _kinds_breakdown(store: Any, seen: set[int]) -> list[tuple[str, int]]:
    """What the store holds by kind that no other holder does (sized last)."""
    return [(f"ObjectStore kind {kind}", _deep(objs, seen))
            for kind, objs in store._kinds.items()]


def trim(out: str) -> None:
    """What glibc gives back once asked (``malloc_trim``), before the census allocates."""
    me = psutil.Process()
    rss_before = me.memory_info().rss
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fp = libc.fopen(os.path.join(out, "malloc_info.xml").encode(), b"w")
    if fp:  # glibc's arenas before the trim: what each holds, in use and free
        libc.malloc_info(0, fp)
        libc.fclose(fp)
    libc.malloc_trim(0)
    with open(os.path.join(out, "trim.txt"), "w") as f:
        f.write(f"RSS {rss_before / 2**20:.0f} MB, after malloc_trim(0) "
                f"{me.memory_info().rss / 2**20:.0f} MB\n")


def _size_len(v: object) -> tuple[int, int]:
    return sys.getsizeof(v), len(v) if isinstance(v, (tuple, set, dict, list, str)) else 0


def _indexes(holders: list[object]) -> list[str]:
    rows = []
    for obj in holders:
        for name, value in getattr(obj, "__dict__", {}).items():
            if not isinstance(value, dict) or len(value) < 50:
                continue
            shallow = sum(sys.getsizeof(v) for v in value.values())
            kinds = collections.Counter(
                type(v).__name__ + (f"[{len(v)}]" if isinstance(v, (tuple, set, dict, list))
                                    and len(v) < 4 else "") for v in value.values())
            rows.append((sys.getsizeof(value) + shallow,
                         f"{type(obj).__name__}.{name}: {len(value)} entries, "
                         f"{sys.getsizeof(value) / 2**20:.1f} + {shallow / 2**20:.1f} MB, "
                         f"{dict(kinds.most_common(4))}, largest values "
                         f"{sorted(_size_len(v) for v in value.values())[-3:]}"))
    return [r for _, r in sorted(rows, reverse=True)]


def _child(out: str, argv: list[str]) -> None:
    """The agent, with the trim on SIGUSR1 and the census on SIGUSR2."""
    signal.signal(signal.SIGUSR1, lambda *_: trim(out))
    signal.signal(signal.SIGUSR2, lambda *_: census(out))
    sys.argv = ["agent.cli", *argv]
    runpy.run_module("agent.cli", run_name="__main__")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3:])
        return 0
    from agent.netns.pin import release_mounts_under
    from bench.agent_scale import Cluster
    from bench.common import progress

    ap = argparse.ArgumentParser(prog="python -m bench.agent_census")
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--local", type=int, default=110)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="aether-census-"))
    os.makedirs(out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="aether-census-run-")
    c = Cluster(root, a.pods, a.services, a.nodes, a.local)
    c.entry = ("-m", "bench.agent_census", "--child", out)
    try:
        progress(f"loading the API server with {a.pods} Pods, {a.services} Services …")
        c.start_api()
        ready = c.start_agent()
        mem = c.memory()
        progress(f"ready in {ready:.1f} s, agent RSS {mem['agent_rss_mb']:.0f} MB; counting …")
        assert c.agent is not None
        os.kill(c.agent.pid, signal.SIGUSR1)
        trimmed = os.path.join(out, "trim.txt")
        while not os.path.exists(trimmed):
            time.sleep(0.2)
        time.sleep(0.2)
        with open(trimmed) as f:
            progress(f.read().strip())
        os.kill(c.agent.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(out, DONE)):
            if time.monotonic() > deadline:
                raise RuntimeError("the agent wrote no census within 600 s")
            time.sleep(0.5)
        with open(os.path.join(out, "census.txt")) as f:
            print(f.read())
        print(f"(and {os.path.join(out, 'mallocstats.txt')})")
    finally:
        c.stop()
        release_mounts_under(root)  # the agent's shared <run-dir>/netns mount
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
