"""Write the standalone `aether-cni` executable kubelet runs.

Two builds of the same thin shim: the native one (`shim.c`, compiled once with the system C
compiler and cached) starts in about a millisecond and needs nothing on the host; the Python
one (`plugin.py` behind a lean `#!python -IS` line) is the fallback where no compiler is
available. The agent side (agent/cni/request.py) is the same for both.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN_SOURCE = Path(__file__).with_name("plugin.py")
NATIVE_SOURCE = Path(__file__).with_name("shim.c")
CACHE_DIR = os.environ.get("AETHER_SHIM_CACHE", "/var/cache/aether")


def shim_text(python: str) -> str:
    return f"#!{python} -IS\n" + PLUGIN_SOURCE.read_text(encoding="utf-8")


def _atomic(dest_path: str, data: bytes, mode: int = 0o755) -> None:
    directory = os.path.dirname(dest_path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".aether-cni.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, dest_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def native_binary() -> str | None:
    """The compiled shim (built on first use, cached by source hash); None without a C
    compiler. Static when libc.a is there, so the binary runs on any Linux host."""
    src = NATIVE_SOURCE.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:16]
    path = os.path.join(CACHE_DIR, f"aether-cni-{digest}")
    if os.access(path, os.X_OK):
        return path
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    os.makedirs(CACHE_DIR, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".aether-cni-build.", dir=CACHE_DIR)
    os.close(fd)
    try:
        for extra in (["-static"], []):
            r = subprocess.run([cc, "-O2", *extra, "-o", tmp, str(NATIVE_SOURCE)],
                               capture_output=True, check=False)
            if r.returncode == 0:
                os.chmod(tmp, 0o755)
                os.replace(tmp, path)
                return path
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_shim(dest_path: str, python: str | None = None, native: bool | None = None) -> str:
    """Atomically install the shim at dest_path (mode 0755); returns "native" or "python".
    ``native`` None follows AETHER_SHIM (default native, falling back to python)."""
    if native is None:
        native = os.environ.get("AETHER_SHIM", "native") == "native"
    binary = native_binary() if native else None
    if binary is not None:
        _atomic(dest_path, Path(binary).read_bytes())
        return "native"
    _atomic(dest_path, shim_text(python or os.path.realpath(sys.executable)).encode())
    return "python"
