"""The test API server holding a cluster's worth of objects, as a process of its own.

    python -m bench.scale_api --pods N --services S --nodes K --local L --dir DIR

Loads the objects (``bench.scale_objects``) and encodes each as a list item once (a real
API server serves lists from memory, on machines of its own: the first LIST's encoding is
not the agent's cost), writes ``DIR/kubeconfig``, prints ``READY`` and serves until
killed. A process of its own so the agent's CPU and memory are measured apart
from the server's (in a real cluster the API server runs elsewhere).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from agent.testing import FakeApiServer
from bench.scale_objects import cluster


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_api")
    ap.add_argument("--pods", type=int, required=True)
    ap.add_argument("--services", type=int, required=True)
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--local", type=int, default=110)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    srv = FakeApiServer(bookmark_interval=5.0, history_limit=100_000).start()
    n = srv.bulk_load(cluster(a.pods, a.services, a.nodes, a.local), encode=True)
    srv.kubeconfig(os.path.join(a.dir, "kubeconfig"))
    print(f"READY {n} objects at {srv.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
