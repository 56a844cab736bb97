"""Client-side calibration: a per-request host overhead is fitted apart from ``c_fwd`` when the
design has prefills of more than one forward (stack/calibrate/design.py, fit.py)."""

from __future__ import annotations

import random

import pytest

from stack.calibrate.design import forwards, make_design
from stack.calibrate.fit import HOST_TERM, Sample, fit_prefill, separates_host
from stack.core.cost_model import CostModel

CHUNK = 4096


def _samples(design, true: CostModel, host: float, noise: float = 0.0) -> list[Sample]:
    rng = random.Random(1)
    out = []
    for p in design.prefill:
        for _ in range(design.repeats):
            n, L = p.new_tokens, p.context
            t = sum(
                true.cost(min(CHUNK, n - done), L - n + min(done + CHUNK, n)) for done in range(0, n, CHUNK)
            )
            out.append(Sample((n, L), (t + host) * (1 + rng.gauss(0, noise)), p.index, p.holdout))
    return out


def test_design_adds_uncached_multi_forward_points_never_held_out():
    d = make_design(16384, CHUNK, repeats=2, holdout_every=3, multi_forward_chunk=CHUNK)
    extra = [p for p in d.prefill if p.new_tokens > CHUNK]
    assert sorted(p.new_tokens for p in extra) == [2 * CHUNK, 3 * CHUNK]
    assert all(p.cached_tokens == 0 and not p.holdout for p in extra)
    assert len({p.index for p in d.prefill}) == len(d.prefill)
    plain = make_design(16384, CHUNK, repeats=2, holdout_every=3)
    assert all(p.new_tokens <= CHUNK for p in plain.prefill)
    # no room for a second chunk: nothing added
    assert all(p.new_tokens <= CHUNK for p in make_design(6000, CHUNK, multi_forward_chunk=CHUNK).prefill)


def test_host_overhead_is_fitted_apart_from_c_fwd():
    true = CostModel(1.2e-5, 1.35e-9, 0.015)
    d = make_design(16384, CHUNK, repeats=2, holdout_every=4, multi_forward_chunk=CHUNK)
    s = _samples(d, true, host=0.003, noise=0.002)
    assert separates_host(s, CHUNK)
    cost, fit = fit_prefill(s, CHUNK, "min", "no", host=True)
    host = dict(zip(fit.names, fit.coef))[HOST_TERM]
    assert host == pytest.approx(0.003, rel=0.15)
    for k in ("c_linear", "c_attn", "c_fwd"):
        assert getattr(cost, k) == pytest.approx(getattr(true, k), rel=0.05), k
    # without the term the overhead lands in c_fwd
    cost3, fit3 = fit_prefill(s, CHUNK, "min", "no", host=False)
    assert HOST_TERM not in fit3.names and cost3.c_fwd > 1.1 * true.c_fwd


def test_host_term_is_not_fitted_when_every_point_takes_one_forward():
    true = CostModel(1.2e-5, 1.35e-9, 0.015)
    d = make_design(16384, CHUNK, repeats=2, holdout_every=4)
    s = _samples(d, true, host=0.003)
    assert not separates_host(s, CHUNK) and forwards(CHUNK, CHUNK) == 1
    _, fit = fit_prefill(s, CHUNK, "min", "no", host=True)
    assert HOST_TERM not in fit.names
