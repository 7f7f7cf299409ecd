"""Hypothesis: random exploration on a developer's machine, a fixed seed in CI (CI=true), so
a CI run is reproducible and a property failure found locally is never a CI coin flip."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
