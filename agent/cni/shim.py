"""Write the standalone `aether-cni` executable: the self-contained plugin source behind a
lean interpreter line (`-IS`: isolated, no site-packages scan, no user paths), which halves the
shim's start-up, the largest share of a pod ADD."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

PLUGIN_SOURCE = Path(__file__).with_name("plugin.py")


def shim_text(python: str) -> str:
    return f"#!{python} -IS\n" + PLUGIN_SOURCE.read_text(encoding="utf-8")


def write_shim(dest_path: str, python: str | None = None) -> None:
    """Atomically install the shim at dest_path (mode 0755)."""
    text = shim_text(python or os.path.realpath(sys.executable))
    directory = os.path.dirname(dest_path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".aether-cni.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
