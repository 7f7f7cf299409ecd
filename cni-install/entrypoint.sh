#!/bin/sh
# The init container's (and the --watch sidecar's) entry: flags pass straight through.
# `python -m` rather than the console script so the image works before/without entry points.
set -eu
exec python3 -m agent.install.cli "$@"
