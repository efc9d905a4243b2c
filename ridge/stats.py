"""Summary statistics of measured samples: the one percentile every report and benchmark uses.

``percentile(values, q)`` interpolates linearly between the two nearest order statistics
(position ``(n - 1) q / 100`` in the sorted samples): numpy's default ``"linear"`` method,
and ``statistics.quantiles(..., method="inclusive")``. So the median of an even count is the
mean of the middle two, p0 is the minimum and p100 the maximum, whatever the sample size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of ``values`` (any order); NaN where there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
