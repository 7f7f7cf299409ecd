"""Parse one big manifest file in a child process, so the agent's own threads never wait for it.

A big file's parse is seconds of CPU (an 8 MB file: ~7 s with libyaml on a small node). In
the agent's process that time holds the GIL in long stretches, and every CNI ADD thread that
releases the GIL for a syscall waits for it again (up to 5 ms per wait, hundreds of waits
per ADD). In a child it runs on another CPU; the agent only unpickles the result, a chunk
at a time (``agent.source.pace``). The child also contains what hostile input could still
do past the bounds of ``agent.source.yamlsafe``: it runs under an address-space limit and a
time limit, and a crash of the child refuses the file instead of killing the agent.

Protocol: the file's bytes on stdin; on stdout pickled frames, all from this trusted child:
``("refused", reason)``, or ``("ok", n_objects, warnings)`` followed by lists of
``(key, object)`` pairs, ``CHUNK`` at a time.
"""

from __future__ import annotations

import io
import pickle
import resource
import subprocess
import sys
from typing import Any

from agent.source.manifest_parse import ManifestError, parse_manifest
from agent.source.pace import background_slice

CHUNK = 100  # objects per pickle frame: ~1 ms to unpickle
#: The child's address-space limit (RLIMIT_AS).
CHILD_MEMORY_BYTES = 2 * 1024 * 1024 * 1024
#: How long a child may take for one file before it is killed and the file refused.
CHILD_TIMEOUT_S = 300.0


class ChildFailed(Exception):
    """The child could not be started (the caller may parse in-process instead)."""


def parse_in_child(path: str, data: bytes, *, timeout: float = CHILD_TIMEOUT_S,
                   memory: int = CHILD_MEMORY_BYTES
                   ) -> tuple[dict[Any, dict[str, Any]], list[str]]:
    """``parse_manifest(path, data)`` in a child; ManifestError as it would raise (and for a
    child that crashed, ran out of memory or time), ChildFailed if none could start."""
    cmd = [sys.executable, "-m", "agent.source.parse_worker", path, str(memory)]
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True)
    except OSError as e:
        raise ChildFailed(f"cannot start the parser process: {e}") from e
    try:
        out, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        raise ManifestError(f"refused: parsing took longer than {timeout:.0f}s") from e
    if proc.returncode != 0:
        why = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exit status {proc.returncode}")
        tail = " ".join(err.decode(errors="replace").split()[-12:])
        raise ManifestError(f"refused: the parser process failed ({why}){': ' + tail if tail else ''}")
    stream = io.BytesIO(out)
    try:
        head = pickle.load(stream)
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError) as e:
        raise ManifestError(f"refused: unreadable answer from the parser process ({e})") from e
    if head[0] == "refused":
        raise ManifestError(str(head[1]))
    try:
        _, count, warnings = head
        objects: dict[Any, dict[str, Any]] = {}
        while len(objects) < count:
            with background_slice():  # CNI threads get the GIL between chunks
                objects.update(pickle.load(stream))
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError) as e:
        raise ManifestError(f"refused: unreadable answer from the parser process ({e})") from e
    return objects, list(warnings)


def main() -> None:
    path, memory = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    data = sys.stdin.buffer.read()
    out = sys.stdout.buffer
    try:
        objects, warnings = parse_manifest(path, data)
    except ManifestError as e:
        pickle.dump(("refused", str(e)), out)
        return
    items = list(objects.items())
    pickle.dump(("ok", len(items), warnings), out, protocol=pickle.HIGHEST_PROTOCOL)
    for i in range(0, len(items), CHUNK):
        pickle.dump(items[i:i + CHUNK], out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()


if __name__ == "__main__":
    main()
