"""Gateway API durations (GEP-2257: 1-4 number-unit pairs, units h, m, s, ms), shared by the
route tables and the backend policies. Pure."""

from __future__ import annotations

import re
from typing import Any

_DURATION = re.compile(r"^(?:[0-9]{1,5}(?:h|m|s|ms)){1,4}\Z")
_DURATION_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def seconds(value: Any) -> float | None:
    """A GEP-2257 duration in seconds ("0s" is 0.0); None when it is not one."""
    if not isinstance(value, str) or not _DURATION.match(value):
        return None
    return sum(int(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(value))
