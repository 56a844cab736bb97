"""The designed sweep of ``smetric calibrate``.

Prefill: a grid of new tokens ``n`` (geometric, ``min_new`` .. ``max_new``) x cached prefix
``c`` (0, then geometric from 1/16 of the room left, ``max_context - n``, to all of it); each point is run ``repeats`` times. A
point with a cached prefix first sends the prefix alone (one output token) so that the
engine caches it, then the prefix plus ``n`` fresh tokens; each repeat extends the same warm
prefix with other fresh tokens. The cost model is linear in its coefficients over the
features ``n``, ``n * (L - n/2)`` and the number of forwards, so a grid over ``n`` and ``L = c + n``
separates the three terms.

Decode: a grid of context lengths x decode steps (output tokens), timed per step.

Held out: every ``holdout_every``-th point of each grid (all its repeats) is kept out of the
fit and only scored (the error the command prints). The points run in a shuffled order, so a
drift of the machine's speed spreads over the grid instead of bending the fit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    index: int
    new_tokens: int
    cached_tokens: int  # the prefix warmed first (the engine may cache less: page granularity)
    holdout: bool

    @property
    def context(self) -> int:
        return self.new_tokens + self.cached_tokens


@dataclass(frozen=True, slots=True)
class DecodePoint:
    index: int
    context: int  # prompt tokens
    steps: int  # output tokens (decode steps + the first token)
    holdout: bool


@dataclass(frozen=True, slots=True)
class Design:
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    repeats: int

    def requests(self) -> int:
        """HTTP requests the sweep sends (warm-ups included)."""
        warm = sum(1 for p in self.prefill if p.cached_tokens > 0)
        return warm + self.repeats * (len(self.prefill) + 2 * len(self.decode))


def geometric(lo: int, hi: int, k: int) -> list[int]:
    """``k`` distinct integers from ``lo`` to ``hi`` evenly spaced on a log scale."""
    if k <= 1 or hi <= lo:
        return [max(lo, hi)] if k >= 1 else []
    out = sorted({round(lo * (hi / lo) ** (i / (k - 1))) for i in range(k)})
    return out


def make_design(
    max_context: int,
    max_new: int,
    *,
    min_new: int = 128,
    new_levels: int = 5,
    cached_levels: int = 4,
    decode_contexts: int = 3,
    decode_steps: tuple[int, ...] = (8, 32),
    repeats: int = 3,
    holdout_every: int = 5,
    seed: int = 0,
) -> Design:
    """The sweep (module docstring). ``max_context``: the longest prompt sent; ``max_new``: the
    most new tokens of one prefill; no decode points when ``decode_contexts`` is 0."""
    if max_context < 2 * min_new:
        raise ValueError(f"max_context {max_context} leaves no room for a sweep (min_new {min_new})")
    if repeats < 1 or holdout_every < 2:
        raise ValueError("repeats must be >= 1 and holdout_every >= 2")
    max_new = max(min_new, min(max_new, max_context))
    grid: list[tuple[int, int]] = []
    for n in geometric(min_new, max_new, new_levels):
        room = max_context - n
        cached = [0]
        if room >= min_new and cached_levels > 1:
            cached += geometric(max(min_new, room // 16), room, cached_levels - 1)
        grid += [(n, c) for c in sorted(set(cached))]
    prefill = [PrefillPoint(i, n, c, (i + 1) % holdout_every == 0) for i, (n, c) in enumerate(grid)]
    decode: list[DecodePoint] = []
    if decode_contexts > 0:
        top = max(min_new, max_context - max(decode_steps) - 1)
        ctxs = geometric(min_new, top, decode_contexts)
        pairs = [(c, s) for c in ctxs for s in sorted(set(decode_steps)) if s >= 2]
        decode = [DecodePoint(i, c, s, (i + 1) % holdout_every == 0) for i, (c, s) in enumerate(pairs)]
    rng = random.Random(seed)
    rng.shuffle(prefill)
    rng.shuffle(decode)
    return Design(tuple(prefill), tuple(decode), repeats)
