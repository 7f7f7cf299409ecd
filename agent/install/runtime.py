"""The plugin executable on the host: the shim script plus a private Python runtime.

kubelet runs `aether-cni` on the host, where no Python may exist (or a different one), so we
ship the interpreter the agent image runs, with just enough stdlib, under `<bin>/aether/`,
and point the shim's shebang at it. Only glibc (libc, libm) is taken from the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import agent.cni

SHIM_NAME = "aether-cni"
OURS_DIR = "aether"
RUNTIME_DIR = "runtime"
#: Linux passes everything after the interpreter as ONE argument: `-I -S` would not parse.
PY_FLAGS = "-IS"
SHEBANG_MAX = 255
PROTOCOL_IMPORT = "from agent.cni import protocol as p"

# stdlib parts the shim never needs (and that are big): skipped when copying the runtime
_SKIP_TOP = {
    "site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo", "ensurepip",
    "lib2to3", "distutils", "pydoc_data", "venv", "sqlite3", "curses", "dbm", "unittest",
}
_SKIP_ANY = {"test", "tests", "idle_test"}
_SKIP_DYNLOAD = re.compile(r"^(_test|_ctypes_test|_xxtest|xxlimited|_tkinter|_curses|_sqlite|"
                           r"_xxsubinterpreters|audioop|nis|ossaudiodev|spwd|readline)")


class InstallError(RuntimeError):
    """The plugin could not be installed or does not start once installed."""


# ---- the shim ---------------------------------------------------------------------------

def plugin_source() -> str:
    """`agent/cni/plugin.py` as one self-contained stdlib script (protocol inlined if needed)."""
    pkg = Path(agent.cni.__file__).parent
    src = (pkg / "plugin.py").read_text()
    if not re.search(r"^\s*(from|import)\s+agent\b", src, re.MULTILINE):
        return src
    if PROTOCOL_IMPORT not in src:
        raise InstallError("agent/cni/plugin.py imports agent modules the installer cannot inline")
    proto = (pkg / "protocol.py").read_text()
    inline = (
        "import types as _types\n"
        "p = _types.ModuleType('aether_cni_protocol')\n"
        f"exec(compile({proto!r}, 'aether_cni_protocol.py', 'exec'), p.__dict__)\n"
    )
    return src.replace(PROTOCOL_IMPORT, inline)


def shim_text(python: str) -> str:
    """The lead's `agent.cni.shim` text (same `-IS` line) after a shebang length check."""
    line = f"#!{python} {PY_FLAGS}"
    if len(line) > SHEBANG_MAX:
        raise InstallError(f"interpreter path too long for a shebang ({len(line)} bytes): {python}")
    try:
        from agent.cni.shim import shim_text as lead_shim_text
    except ImportError:
        return f"{line}\n{plugin_source()}"
    return lead_shim_text(python)


def write_atomic(path: str, data: bytes, mode: int) -> bool:
    """Temp file + rename in the same dir; False (nothing written) when already identical.

    The temp name ends in `.tmp` so libcni never takes it for a config file.
    """
    with contextlib.suppress(OSError), open(path, "rb") as f:
        if f.read() == data and (os.stat(path).st_mode & 0o7777) == mode:
            return False
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return True


def write_shim(dest_path: str, python: str) -> bool:
    """The executable plugin at dest_path, interpreted by `python`; True if (re)written."""
    return write_atomic(dest_path, shim_text(python).encode(), 0o755)


def verify_shim(path: str, timeout: float = 15.0) -> list[str]:
    """Run the installed plugin as kubelet would (VERSION, bare env); its supported versions."""
    try:
        proc = subprocess.run([path], input="", env={"CNI_COMMAND": "VERSION"},
                              capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InstallError(f"installed plugin {path} does not start: {e}") from e
    try:
        versions = json.loads(proc.stdout)["supportedVersions"]
    except (ValueError, KeyError, TypeError):
        versions = None
    if proc.returncode != 0 or not isinstance(versions, list):
        raise InstallError(f"installed plugin {path} failed VERSION (exit {proc.returncode}): "
                           f"{proc.stdout.strip()} {proc.stderr.strip()}")
    return [str(v) for v in versions]


# ---- the private runtime ----------------------------------------------------------------

def _elf_dynamic(path: str) -> tuple[list[str], list[tuple[int, str]]]:
    """(DT_NEEDED names, [(file offset, value)] of DT_RPATH/DT_RUNPATH) of a 64-bit LE ELF."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return [], []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    needed: list[str] = []
    paths: list[tuple[int, str]] = []
    for sec in sections:
        if sec[1] != 6:  # SHT_DYNAMIC
            continue
        strtab_off = sections[sec[6]][4]
        off, size = sec[4], sec[5]
        for pos in range(off, off + size, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag in (1, 15, 29):  # DT_NEEDED, DT_RPATH, DT_RUNPATH
                start = strtab_off + val
                value = data[start:data.index(b"\0", start)].decode()
                if tag == 1:
                    needed.append(value)
                else:
                    paths.append((start, value))
    return needed, paths


def make_relocatable(python: str) -> bool:
    """Point an absolute RUNPATH at `$ORIGIN/../lib` in place; True if libpython resolves there.

    The image's python may find libpython through an absolute RUNPATH (pyenv, custom builds)
    that does not exist on the host. Rewriting the string in place (when the new one fits)
    is what `patchelf --set-rpath` would do, without needing patchelf.
    """
    needed, paths = _elf_dynamic(python)
    if not any(n.startswith("libpython") for n in needed):
        return True  # statically linked interpreter
    want = "$ORIGIN/../lib"
    if any(v == want for _, v in paths):
        return True
    for start, value in paths:
        if len(value) >= len(want):
            with open(python, "r+b") as f:
                f.seek(start)
                f.write(want.encode() + b"\0" * (len(value) - len(want)))
            return True
    return False


def _same(src: os.stat_result, dst: str) -> bool:
    try:
        st = os.stat(dst)
    except FileNotFoundError:
        return False
    return st.st_size == src.st_size and int(st.st_mtime) == int(src.st_mtime)


def _copy(src: str, dst: str) -> bool:
    st = os.stat(src)
    if _same(st, dst):
        return False
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp"
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)
    return True


def _skip(rel: Path, is_dir: bool) -> bool:
    parts = rel.parts
    if parts and parts[0] in _SKIP_TOP or any(p in _SKIP_ANY for p in parts):
        return True
    if parts and parts[0].startswith("config-"):
        return True
    name = parts[-1] if parts else ""
    if not is_dir and parts[:1] == ("lib-dynload",) and _SKIP_DYNLOAD.match(name):
        return True
    return not is_dir and "__pycache__" in parts and ".opt-" in name


def runtime_python(bin_dir: str) -> str:
    return os.path.join(bin_dir, OURS_DIR, RUNTIME_DIR, "bin", "python3")


def copy_runtime(bin_dir: str) -> tuple[str, bool, int]:
    """Copy this interpreter + trimmed stdlib to `<bin>/aether/runtime`.

    Returns (python path, whether the shebang can point at it directly, files copied).
    Unchanged files (size + mtime) are skipped, so a re-run or repair is cheap.
    """
    root = os.path.join(bin_dir, OURS_DIR, RUNTIME_DIR)
    exe = os.path.realpath(sys.executable)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = sysconfig.get_paths()["stdlib"]
    copied = 0
    dst_py = os.path.join(root, "bin", ver)
    src_st = os.stat(exe)
    if not _same(src_st, dst_py):
        os.makedirs(os.path.dirname(dst_py), exist_ok=True)
        tmp = f"{dst_py}.tmp"
        shutil.copy2(exe, tmp)
        direct = make_relocatable(tmp)
        os.utime(tmp, ns=(src_st.st_atime_ns, src_st.st_mtime_ns))  # keep the skip test valid
        os.replace(tmp, dst_py)
        copied += 1
    else:
        direct = make_relocatable(dst_py)
    link = os.path.join(root, "bin", "python3")
    if not os.path.islink(link) or os.readlink(link) != ver:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        os.symlink(ver, link)
    needed, _ = _elf_dynamic(exe)
    libdir = sysconfig.get_config_var("LIBDIR") or os.path.join(sys.base_prefix, "lib")
    for lib in needed:
        if lib.startswith("libpython"):
            src = os.path.join(libdir, lib)
            if not os.path.exists(src):
                raise InstallError(f"{exe} needs {lib}, not found in {libdir}")
            copied += _copy(os.path.realpath(src), os.path.join(root, "lib", lib))
    dst_lib = os.path.join(root, "lib", ver)
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = Path(dirpath).relative_to(stdlib)
        dirnames[:] = [d for d in dirnames if not _skip(rel_dir / d, True)]
        for name in filenames:
            if _skip(rel_dir / name, False):
                continue
            copied += _copy(os.path.join(dirpath, name), os.path.join(dst_lib, rel_dir, name))
    return os.path.join(root, "bin", "python3"), direct, copied


def wrapper_text(bin_dir: str) -> str:
    """The fallback shim when libpython cannot be found via RUNPATH: /bin/sh sets the path."""
    root = os.path.join(bin_dir, OURS_DIR, RUNTIME_DIR)
    script = os.path.join(bin_dir, OURS_DIR, "aether-cni.py")
    return (f"#!/bin/sh\nLD_LIBRARY_PATH='{root}/lib' exec '{root}/bin/python3' {PY_FLAGS} "
            f"'{script}' \"$@\"\n")


def install_plugin(bin_dir: str, python_runtime: str = "copy") -> tuple[bool, str]:
    """Install the shim (and runtime); returns (anything changed, interpreter used)."""
    os.makedirs(bin_dir, exist_ok=True)
    shim = os.path.join(bin_dir, SHIM_NAME)
    if python_runtime == "native":
        return write_atomic(shim, expected_shim(bin_dir, "native"), 0o755), "none (native shim)"
    if python_runtime == "host":
        python = os.path.realpath(sys.executable)
        return write_shim(shim, python), python
    if python_runtime != "copy":
        raise InstallError(
            f"--python-runtime must be native, copy or host, not {python_runtime!r}")
    python, direct, copied = copy_runtime(bin_dir)
    if direct:
        changed = write_shim(shim, python)
    else:
        script = os.path.join(bin_dir, OURS_DIR, "aether-cni.py")
        changed = write_atomic(script, plugin_source().encode(), 0o644)
        changed = write_atomic(shim, wrapper_text(bin_dir).encode(), 0o755) or changed
    return changed or copied > 0, python


def expected_shim(bin_dir: str, python_runtime: str) -> bytes:
    """What `<bin>/aether-cni` must contain (the watch loop compares against it)."""
    if python_runtime == "native":
        from agent.cni.shim import native_binary
        binary = native_binary()
        if binary is None:
            raise InstallError("--python-runtime native needs the compiled shim and no C compiler "
                               "was found to build it (use --python-runtime copy)")
        with open(binary, "rb") as f:
            return f.read()
    if python_runtime == "host":
        return shim_text(os.path.realpath(sys.executable)).encode()
    py = runtime_python(bin_dir)
    if os.path.exists(os.path.join(bin_dir, OURS_DIR, "aether-cni.py")):
        return wrapper_text(bin_dir).encode()
    return shim_text(py).encode()


def plugin_intact(bin_dir: str, python_runtime: str) -> bool:
    """Cheap check for the watch loop: shim content and the runtime's landmark files."""
    shim = os.path.join(bin_dir, SHIM_NAME)
    try:
        with open(shim, "rb") as f:
            if f.read() != expected_shim(bin_dir, python_runtime):
                return False
        if not os.access(shim, os.X_OK):
            return False
    except OSError:
        return False
    if python_runtime in ("host", "native"):
        return True
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    root = os.path.join(bin_dir, OURS_DIR, RUNTIME_DIR)
    return all(os.path.exists(os.path.join(root, p)) for p in
               ("bin/python3", f"lib/{ver}/os.py", f"lib/{ver}/json/__init__.py",
                f"lib/{ver}/encodings/__init__.py", f"lib/{ver}/socket.py"))


def uninstall_plugin(bin_dir: str) -> list[str]:
    """Remove the shim and our directory; the paths removed."""
    removed = []
    shim = os.path.join(bin_dir, SHIM_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shim)
        removed.append(shim)
    ours = os.path.join(bin_dir, OURS_DIR)
    if os.path.isdir(ours):
        shutil.rmtree(ours)
        removed.append(ours)
    return removed
