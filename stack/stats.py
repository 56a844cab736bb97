"""Small statistics shared by the simulator, the replay and the benchmarks."""

from __future__ import annotations


def percentile(sorted_vals: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``sorted_vals`` (sorted ascending), interpolated linearly
    between the two nearest ranks; NaN when there are none."""
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)
