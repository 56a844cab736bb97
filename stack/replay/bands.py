"""What a comparison may claim: bands over seeds, winners named only outside them.

Pure functions over numbers (no simulator, no I/O), so that the rules the main job prints are
tested as rules:

- a policy's **band** is the 10th-90th percentile range of its simulated figure over
  :data:`MIN_SEEDS` or more seeds of the same workload (:func:`band`);
- two policies are compared by the **paired ratio** of their figures seed by seed (the same
  arrivals on both sides), and a winner is named only when the ratio's band lies wholly on one
  side of 1 (:func:`compare`); otherwise the scale cannot tell them apart, and
  :func:`growth_needed` estimates how much larger the run would have to be;
- a single live run is held to the model's band, widened by the **chaos floor**: how far the
  simulated figure moves when nothing changes but a tiny perturbation of the arrivals
  (:func:`held_to`, :func:`live_claim`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: the fewest seeds a band is computed over
MIN_SEEDS = 10


@dataclass(frozen=True)
class Band:
    """The 10th, 50th and 90th percentiles of ``n`` values."""

    p10: float
    median: float
    p90: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the band relative to its median (the band is median * (1 +- half_width))."""
        if self.median == 0:
            return math.inf
        return max(self.median - self.p10, self.p90 - self.median) / abs(self.median)

    def contains(self, x: float, widen: float = 0.0) -> bool:
        """Whether ``x`` lies in the band, each edge moved out by ``widen`` (relative)."""
        return self.p10 * (1 - widen) <= x <= self.p90 * (1 + widen)

    def as_dict(self) -> dict:
        return {"p10": self.p10, "median": self.median, "p90": self.p90, "n": self.n}


def band(values: Sequence[float], min_n: int = MIN_SEEDS) -> Band:
    """The band of ``values`` (at least ``min_n`` finite values; ValueError otherwise)."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if len(xs) < min_n:
        raise ValueError(f"a band needs at least {min_n} values, got {len(xs)}")
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return Band(q[0], statistics.median(xs), q[-1], len(xs))


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Seed-by-seed ``a / b`` (the same seeds, in the same order)."""
    if len(a) != len(b):
        raise ValueError("paired ratios need the same seeds on both sides")
    return [x / y if y else math.inf for x, y in zip(a, b, strict=True)]


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    ratio: Band  # a / b, seed by seed
    winner: str | None  # a, b, or None: the band contains 1

    @property
    def margin(self) -> float:
        """How far the median ratio is from a tie (relative)."""
        return abs(self.ratio.median - 1.0)

    def sentence(self) -> str:
        r = self.ratio
        span = f"x{r.median:.3f} (band x{r.p10:.3f}-x{r.p90:.3f} over {r.n} seeds)"
        if self.winner == self.a:
            return f"{self.a} beats {self.b}: {span}"
        if self.winner == self.b:
            return f"{self.b} beats {self.a}: {self.a} at {span}"
        return f"no clear winner between {self.a} and {self.b}: {self.a} at {span}, a band that holds x1"


def compare(a: str, fa: Sequence[float], b: str, fb: Sequence[float], min_n: int = MIN_SEEDS) -> Comparison:
    """``a`` against ``b`` by their figures on the same seeds: a winner only when the paired
    ratio's whole band is above 1 (``a``) or below 1 (``b``)."""
    r = band(ratios(fa, fb), min_n)
    winner = a if r.p10 > 1.0 else b if r.p90 < 1.0 else None
    return Comparison(a, b, r, winner)


def growth_needed(c: Comparison) -> float | None:
    """For a comparison without a winner: roughly how many times more sessions (a longer or
    larger run) would shrink the ratio's band enough to exclude 1, assuming the band narrows
    as one over the square root of the sessions; None when the medians tie (no growth does)."""
    if c.winner is not None:
        return 1.0
    if c.margin < 1e-3:
        return None
    r = c.ratio
    toward = r.p90 - r.median if r.median < 1.0 else r.median - r.p10  # the band's side that holds 1
    return max(1.0, (toward / c.margin) ** 2)


def chaos_floor(perturbed: Sequence[float], min_n: int = MIN_SEEDS) -> float:
    """The chaos floor of one figure: the half width of its band over perturbations of one
    seed (:attr:`stack.sim.load.LoadSpec.perturb`)."""
    return band(perturbed, min_n).half_width


def held_to(live: float, model: Band, floor: float) -> bool:
    """Whether a live figure lies in its model's band, widened by the chaos floor."""
    return model.contains(live, floor)


def live_claim(c: Comparison, live_ratio: float, floor: float) -> tuple[str | None, bool]:
    """What one live run says about ``c``: its winner (None when the live ratio is within the
    chaos floor of a tie) and whether it agrees with the simulated comparison. A live run
    disagrees only when it names a winner the model does not, or the other one."""
    if live_ratio > 1.0 + floor:
        live = c.a
    elif live_ratio < 1.0 / (1.0 + floor):
        live = c.b
    else:
        live = None
    if live is None:
        agree = True  # a tie live is not evidence against the model at one run
    elif c.winner is None:
        agree = c.ratio.contains(live_ratio, floor)
    else:
        agree = live == c.winner
    return live, agree
