"""The fits of ``smetric calibrate`` and of the router's learned cost model.

Prefill: ``cost(n, L) = c_linear * n + c_attn * n * (L - n/2) + c_fwd * forwards(n)`` is linear
in its three coefficients, so they come from non-negative least squares
(``scipy.optimize.nnls``) over the features ``[n, n * (L - n/2), forwards]``. Each row is
divided by its measured time: the fit minimises the squared *relative* error, the figure a
routing decision cares about (a 10 ms error matters at 50 ms, not at 5 s); the columns are
scaled to comparable sizes before solving and the coefficients scaled back. Repeats of one
design point are reduced first: to their median (engine-side timings), or to their fastest
(client-side wall clocks, which host hiccups and a shared machine only ever lengthen).

An engine whose attention kernel runs a query for every context position, cached or not
(SGLang's ``torch_native`` backend, the one a CPU build without ``sgl_kernel``'s CPU ops
has), spends ``c_prefix * p**2 / 2`` more on a prefill with ``p`` tokens cached: the fourth
feature, fitted on request (``prefix``), :func:`fit_prefill`.

Decode (one running request): ``step(1, C) = d_fwd + d_ctx * C`` over the context ``C``, by the
same method. One request at a time cannot tell the dense weights' read (``d_fwd``) from the
experts' (``d_experts``), so the fit reports ``d_experts = 0`` with all of it in ``d_fwd``
(exact at batch 1, a dense model's reading at larger batches).

The error reported is the mean absolute percentage error (MAPE) of the fitted model on the
held-out points, which took no part in the fit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import nnls

from stack.core.cost_model import CostModel


def forwards(new_tokens: float, chunk_tokens: int | None) -> float:
    """Forwards a prefill of ``new_tokens`` takes under chunked prefill (``chunk_tokens``)."""
    if new_tokens <= 0:
        return 0.0
    if not chunk_tokens:
        return 1.0
    return float(math.ceil(new_tokens / chunk_tokens))


@dataclass(frozen=True, slots=True)
class Sample:
    """One measurement: ``x`` its features' inputs (prefill: new tokens, context; decode:
    context), ``seconds`` measured, ``point`` the design point it repeats."""

    x: tuple[float, ...]
    seconds: float
    point: int
    holdout: bool = False


@dataclass(frozen=True, slots=True)
class Point:
    """A design point's median: inputs, measured and predicted seconds."""

    x: tuple[float, ...]
    measured: float
    predicted: float
    holdout: bool
    repeats: int

    @property
    def error(self) -> float:
        return abs(self.predicted - self.measured) / self.measured


@dataclass(frozen=True, slots=True)
class LinearFit:
    coef: tuple[float, ...]
    points: tuple[Point, ...]
    train_mape: float
    holdout_mape: float  # nan with no held-out point
    n_train: int
    n_holdout: int
    names: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {
            **dict(zip(self.names, self.coef)),
            "train_mape": self.train_mape,
            "holdout_mape": self.holdout_mape,
            "train_points": self.n_train,
            "holdout_points": self.n_holdout,
        }


#: the golden ratio's fractional part, (sqrt(5) - 1) / 2
GOLDEN = 0.6180339887498949


def held_out(rows: int, every: int) -> np.ndarray:
    """Which of ``rows`` rows, in the order they were recorded, are scored rather than fitted: one
    in each full block of ``every`` consecutive rows (``rows // every`` in all, as many as
    "every ``every``-th" holds out). Its place in block ``b`` is ``floor(every * frac(b * g))``,
    ``g`` the golden ratio's fractional part: a sequence that never repeats with a period and
    spreads the places evenly over a few blocks, the same at every refit. So traffic that
    repeats with a period dividing ``every`` (a client cycling through five prompt sizes) is not
    held out at one size only; a fit that never sees its largest prompts and is scored on them
    alone measures extrapolation, not its error."""
    if every < 2:
        raise ValueError(f"every must be >= 2, not {every}")
    mask = np.zeros(rows, dtype=bool)
    blocks = np.arange(rows // every)
    mask[blocks * every + np.floor(every * np.modf(blocks * GOLDEN)[0]).astype(np.intp)] = True
    return mask


def mape(measured: Sequence[float], predicted: Sequence[float]) -> float:
    """Mean absolute percentage error (a fraction; nan for no points)."""
    if not measured:
        return math.nan
    return float(np.mean([abs(p - m) / m for m, p in zip(measured, predicted)]))


def reduce_points(
    samples: Sequence[Sample], how: str = "median"
) -> list[tuple[tuple[float, ...], float, bool, int]]:
    """Per design point: (inputs, seconds, held out, repeats). ``median``: the median of its
    repeats (inputs too); ``min``: its fastest repeat (the best-of-k of microbenchmarks: what
    a wall clock adds, host hiccups and interference, only ever adds)."""
    if how not in ("median", "min"):
        raise ValueError(f"reduce must be median or min, not {how!r}")
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.point].append(s)
    out = []
    for _, g in sorted(groups.items()):
        if how == "min":
            best = min(g, key=lambda s: s.seconds)
            out.append((best.x, best.seconds, g[0].holdout, len(g)))
            continue
        xs = tuple(float(np.median([s.x[j] for s in g])) for j in range(len(g[0].x)))
        out.append((xs, float(np.median([s.seconds for s in g])), g[0].holdout, len(g)))
    return out


def nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative ``x`` minimising ``sum(((a @ x - y) / y) ** 2)``."""
    w = a / y[:, None]
    scale = np.abs(w).max(axis=0)
    scale[scale == 0] = 1.0
    xs, _ = nnls(w / scale, np.ones(len(y)))
    return xs / scale


def fit_linear(samples: Sequence[Sample], features, names: tuple[str, ...], how: str = "median") -> LinearFit:
    """Fit ``seconds ~ features(x) @ coef`` (coef >= 0) on the points not held out (each point
    its repeats reduced as ``how`` says: :func:`reduce_points`)."""
    pts = [p for p in reduce_points(samples, how) if p[1] > 0]
    train = [p for p in pts if not p[2]]
    if len(train) < len(names):
        raise ValueError(f"{len(train)} design points to fit {len(names)} coefficients: too few measurements")
    a = np.array([features(p[0]) for p in train], dtype=float)
    y = np.array([p[1] for p in train], dtype=float)
    coef = nnls_relative(a, y)
    points = tuple(Point(x, m, float(np.dot(features(x), coef)), hold, reps) for x, m, hold, reps in pts)
    tr = [p for p in points if not p.holdout]
    ho = [p for p in points if p.holdout]
    return LinearFit(
        tuple(float(c) for c in coef),
        points,
        mape([p.measured for p in tr], [p.predicted for p in tr]),
        mape([p.measured for p in ho], [p.predicted for p in ho]),
        len(tr),
        len(ho),
        names,
    )


PREFILL_TERMS = ("c_linear", "c_attn", "c_fwd")
PREFIX_TERMS = (*PREFILL_TERMS, "c_prefix")
DECODE_TERMS = ("d_fwd", "d_ctx")
#: ``auto`` takes the prefix term only when it cuts the fit's own error (not the held-out
#: points') by at least this factor
PREFIX_GAIN = 1.5


def prefix_pairs(n: float, L: float, chunk_tokens: int | None) -> float:
    """``sum p**2 / 2`` over the forwards of a prefill of ``n`` tokens ending at ``L``, ``p`` the
    context before each forward: the attention an engine recomputes over what is already
    cached when its kernel runs every context position's query (SGLang ``torch_native``)."""
    start = L - n
    if not chunk_tokens or n <= chunk_tokens:
        return 0.5 * start * start
    tot, done = 0.0, 0.0
    while done < n:
        p = start + done
        tot += 0.5 * p * p
        done += chunk_tokens
    return tot


def prefill_features(chunk_tokens: int | None, prefix: bool = False):
    """Features of a prefill sample ``x = (new tokens, context)`` (``prefix``: with the
    recomputed-prefix term, :func:`prefix_pairs`)."""

    def f(x: tuple[float, ...]) -> list[float]:
        n, L = x[0], x[1]
        row = [n, n * (L - 0.5 * n), forwards(n, chunk_tokens)]
        return [*row, prefix_pairs(n, L, chunk_tokens)] if prefix else row

    return f


def fit_prefill(
    samples: Sequence[Sample], chunk_tokens: int | None, how: str = "median", prefix: str = "no"
) -> tuple[CostModel, LinearFit]:
    """The prefill cost model from samples ``x = (new tokens, context)``.

    ``prefix``: ``no`` fits the three terms; ``yes`` adds ``c_prefix`` (:func:`prefix_pairs`);
    ``auto`` adds it only when that cuts the fitted points' MAPE by :data:`PREFIX_GAIN` or
    more (the held-out points take no part in the choice). ``fit.names`` says which."""
    if prefix not in ("no", "yes", "auto"):
        raise ValueError(f"prefix must be no, yes or auto, not {prefix!r}")
    fit = None
    if prefix != "yes":
        fit = fit_linear(samples, prefill_features(chunk_tokens), PREFILL_TERMS, how)
    if prefix != "no":
        with_p = fit_linear(samples, prefill_features(chunk_tokens, True), PREFIX_TERMS, how)
        if fit is None or (with_p.coef[3] > 0 and with_p.train_mape * PREFIX_GAIN <= fit.train_mape):
            fit = with_p
    c = fit.coef
    return CostModel(c[0], c[1], c[2], c[3] if len(c) > 3 else 0.0), fit


def _decode_features(x: tuple[float, ...]) -> list[float]:
    return [1.0, x[0]]


def fit_decode(samples: Sequence[Sample], how: str = "median") -> LinearFit:
    """``step = d_fwd + d_ctx * C`` from samples ``x = (context,)`` of seconds per step; with one
    context length only, ``d_ctx = 0`` and ``d_fwd`` its step time."""
    contexts = {round(x[0], -1) for x, _, hold, _ in reduce_points(samples, how) if not hold}
    if len(contexts) >= 2:
        return fit_linear(samples, _decode_features, DECODE_TERMS, how)
    f = fit_linear(samples, lambda x: [1.0], DECODE_TERMS[:1], how)
    return replace(f, coef=(f.coef[0], 0.0), names=DECODE_TERMS)


@dataclass(frozen=True, slots=True)
class RowsFit:
    """A prefill fit over single observations (no design points): the router's learned model."""

    cost: CostModel
    train_mape: float
    holdout_mape: float
    n_train: int
    n_holdout: int


def fit_rows(
    new_tokens: np.ndarray,
    context: np.ndarray,
    seconds: np.ndarray,
    holdout: np.ndarray,
    chunk_tokens: int | None,
) -> RowsFit:
    """:func:`fit_prefill` vectorised over single observations (each its own point; ``holdout``
    a boolean mask of those scored, not fitted): cheap enough to refit on a router's event loop."""
    n = new_tokens.astype(float)
    fwd = np.ones_like(n) if not chunk_tokens else np.ceil(n / chunk_tokens)
    return fit_batches(np.column_stack([n, n * (context - 0.5 * n), fwd]), seconds, holdout)


def batch_features(
    new_tokens: np.ndarray, context: np.ndarray, group: np.ndarray, chunk_tokens: int | None
) -> np.ndarray:
    """The prefill features of rows that are each a group of requests whose forwards ran back
    to back on one worker (a busy stretch of the engine, :mod:`stack.prefill_router.learned_cost`):
    per row ``[sum n, sum n * (L - n/2), forwards(sum n)]``, request ``i`` in row ``group[i]``
    (rows numbered from 0). The per-request terms add up over chunks, so a group costs what its
    requests cost plus ``c_fwd`` per forward; every forward of a group but its last is full (a
    request still running across a forward boundary means the step's budget ran out), so the
    forwards are ``forwards(sum n)``. A group of one is a lone prefill's row (:func:`fit_rows`)."""
    n = np.asarray(new_tokens, dtype=float)
    L = np.asarray(context, dtype=float)
    g = np.asarray(group, dtype=np.intp)
    rows = int(g.max()) + 1 if len(g) else 0
    tot = np.bincount(g, weights=n, minlength=rows)
    attn = np.bincount(g, weights=n * (L - 0.5 * n), minlength=rows)
    fwd = np.ones_like(tot) if not chunk_tokens else np.ceil(tot / chunk_tokens)
    return np.column_stack([tot, attn, np.where(tot > 0, fwd, 0.0)])


def fit_batches(features: np.ndarray, seconds: np.ndarray, holdout: np.ndarray) -> RowsFit:
    """:func:`fit_rows` over rows of :func:`batch_features` (``holdout``: the rows scored, not
    fitted)."""
    y = np.asarray(seconds, dtype=float)
    train = ~holdout
    if int(train.sum()) < 3:
        raise ValueError("fewer than 3 observations to fit")
    coef = nnls_relative(features[train], y[train])
    err = np.abs(features @ coef - y) / y
    ho = err[holdout]
    return RowsFit(
        CostModel(float(coef[0]), float(coef[1]), float(coef[2])),
        float(err[train].mean()),
        float(ho.mean()) if len(ho) else math.nan,
        int(train.sum()),
        int(holdout.sum()),
    )
