"""The main job's claims, from its figures: the verdict and the tables of `smetric demo-live`.

Pure functions over metric dicts; :mod:`stack.replay.bands` holds the rules. The verdict's
words depend only on classifications (who wins where, whether live agrees), never on a
number's last digits, so that runs that measure the same thing print the same verdict.

What a person reads names each policy short (:func:`display_names`): the shipped product's
111-character label is ``product``, its definition printed once (:func:`legend`); the JSON
keeps the full labels beside that mapping.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from stack.replay import bands as B

KEY = "prefill_tps_within_slo"
#: what the report calls the shipped product (the router's default policy behind its default
#: dispatch queue, :data:`stack.bench.main_job.DEFAULT_POLICIES`' first)
PRODUCT = "product"
#: a label longer than this is printed as P1, P2, ... (its definition once, in the legend)
MAX_NAME = 16


def display_names(labels: Sequence[str], product: str) -> dict[str, str]:
    """Each policy label -> the name the report prints: ``product`` for the shipped product's
    label, ``P1``, ``P2``, ... for other labels longer than :data:`MAX_NAME`, the rest as
    they are (``lmetric``, ``least-load``)."""
    out: dict[str, str] = {}
    n = 0
    for label in dict.fromkeys(labels):
        if label == product:
            out[label] = PRODUCT
        elif len(label) > MAX_NAME:
            n += 1
            out[label] = f"P{n}"
        else:
            out[label] = label
    return out


def legend(names: dict[str, str]) -> list[str]:
    """One line per renamed policy: ``product = <its full label>``."""
    return [f"{short} = {label}" for label, short in names.items() if short != label]


def renamer(names: dict[str, str]):
    """A function that writes every renamed label in a text by its short name (longest label
    first, so that a label containing another is replaced whole)."""
    pairs = sorted(((k, v) for k, v in names.items() if k != v), key=lambda kv: -len(kv[0]))
    if not pairs:
        return lambda text: text
    pattern = re.compile("|".join(re.escape(k) for k, _ in pairs))
    table = dict(pairs)
    return lambda text: pattern.sub(lambda m: table[m.group(0)], text)


def tps(runs: Sequence[dict]) -> list[float]:
    return [float(r.get(KEY) or 0.0) for r in runs]


@dataclass(frozen=True)
class ScaleClaim:
    """The cluster-scale comparison: the product against its best baseline on every seed."""

    product: str
    best: str  # the baseline with the highest mean figure
    ratios: tuple[float, ...]  # product / best, seed by seed
    winner: str | None  # product or best when every seed agrees, else None

    def sentence(self) -> str:
        lo, hi = min(self.ratios), max(self.ratios)
        span = f"x{lo:.3f}-x{hi:.3f} over {len(self.ratios)} seeds"
        if self.winner == self.product:
            return f"{self.product} beats the best baseline, {self.best}, on every seed ({span})"
        if self.winner == self.best:
            return f"the best baseline, {self.best}, beats {self.product} on every seed ({span})"
        return f"no clear winner between {self.product} and the best baseline, {self.best} ({span})"


def scale_claim(product: str, runs: dict[str, list[dict]]) -> ScaleClaim:
    """``runs``: per policy (the product and the baselines), its metrics per seed."""
    base = {p: rs for p, rs in runs.items() if p != product}
    if not base:
        raise ValueError("the cluster-scale comparison needs at least one baseline")
    best = max(base, key=lambda p: sum(tps(base[p])) / len(base[p]))
    r = tuple(B.ratios(tps(runs[product]), tps(base[best])))
    winner = product if min(r) > 1.0 else best if max(r) < 1.0 else None
    return ScaleClaim(product, best, r, winner)


@dataclass(frozen=True)
class LiveCheck:
    """One policy's live figure against its model."""

    policy: str
    live: float
    sim: float  # the simulator on the run's own seed
    band: B.Band  # over the band seeds
    floor: float  # the chaos floor (relative)

    @property
    def gap(self) -> float:
        return self.live / self.sim - 1.0 if self.sim else float("nan")

    @property
    def inside(self) -> bool:
        return B.held_to(self.live, self.band, self.floor)


def live_checks(
    live: dict[str, float], sim: dict[str, float], seed_runs: dict[str, list[dict]], floors: dict[str, float]
) -> list[LiveCheck]:
    return [LiveCheck(p, live[p], sim[p], B.band(tps(seed_runs[p])), floors.get(p, 0.0)) for p in live]


def verdict(
    scale: ScaleClaim | None,
    comparisons: Sequence[B.Comparison],
    live_claims: Sequence[tuple[B.Comparison, str | None, bool]],
    checks: Sequence[LiveCheck],
    instances: int,
) -> str:
    """A few lines: the cluster-scale claim, the claim at the main job's scale, and whether
    the live run agrees with its model (its own winner, and every live figure in its band);
    the first starts ``verdict: ``, each next one is indented."""
    parts = []
    if scale is not None:
        parts.append(f"at cluster scale (simulated) {_short(scale)}")
    for c in comparisons:
        if c.winner is None:
            g = B.growth_needed(c)
            more = "no size would split them" if g is None else f"about {g:.1f}x the sessions would be needed"
            parts.append(f"at {instances} instances {c.a} and {c.b} cannot be told apart ({more})")
        else:
            loser = c.b if c.winner == c.a else c.a
            parts.append(f"at {instances} instances {c.winner} beats {loser}")
    if live_claims or checks:
        agree = all(a for _, _, a in live_claims)
        inside = all(ch.inside for ch in checks)
        words = "live agrees with the model" if agree else "live and simulated DISAGREE"
        words += (
            ", every live figure in its band"
            if inside
            else f", {sum(not ch.inside for ch in checks)} live figure(s) OUTSIDE their band"
        )
        parts.append(words)
    return "verdict: " + ";\n  ".join(parts)


def _short(s: ScaleClaim) -> str:
    if s.winner == s.product:
        return f"{s.product} beats the best baseline, {s.best}, on every seed"
    if s.winner == s.best:
        return f"the best baseline, {s.best}, beats {s.product} on every seed"
    return f"{s.product} and the best baseline, {s.best}, cannot be told apart"
