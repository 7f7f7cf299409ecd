"""What AuthorizationPolicies cost the mTLS keep-alive path, in instructions (#41): the setup
of ``bench.authz_cost`` with the node Envoy under callgrind (the agent is given a wrapper as
``--envoy-binary``), each phase's instructions over the requests wrk completed in it, with
the ten policies over none, per round. Deterministic where a shared VM's CPU clock is not;
Envoy runs ~50× slower there, so each phase is a few thousand requests. With
``AETHER_BENCH_KEEP_DUMPS=<dir>`` each phase's dump is kept for ``callgrind_annotate``.

    python3 -m bench.authz_instructions [--rounds 3] [--duration 10] [--quick] [--json F]
"""

from __future__ import annotations

import sys

from bench.authz_cost import main_callgrind

if __name__ == "__main__":
    sys.exit(main_callgrind())
