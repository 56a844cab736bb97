"""Run a grid of simulations (policy x setting x rate) on an executor.

Where the simulations run (this process, local worker processes, Ray tasks) is the
executor's business (:mod:`stack.bench.executors`); this module says what one simulation
is (:class:`Job`, :func:`run_one`); which to run is :mod:`stack.bench.rate_search`'s. A
job returns one CSV row (the setting's columns, the rate and every metric `smetric sim`
writes) and, for the plots, quantile summaries of its TTFTs and per-window imbalance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

from stack.bench.experiments import Setting
from stack.bench.summary import run_label
from stack.dispatch import SIM_DISPATCH, DispatchSpec
from stack.sim.engine import make_simulator
from stack.sim.options import SimOptions
from stack.traces.model import Trace

N_TTFT_Q = 200
N_IMB_Q = 100


def setting_options(base: SimOptions, s: Setting) -> SimOptions:
    """The command line's options with setting ``s``'s overrides applied (what it leaves
    unset keeps the command line's value)."""
    return base.override(
        instances=s.instances,
        hbm_tokens=s.hbm_tokens,
        global_tier=s.global_tier,
        link=s.link,
        slo_b=s.slo_b,
        slo_a=s.slo_a,
        mode=s.mode,
    )


@dataclass(frozen=True)
class Job:
    policy: str
    setting: int  # index into the settings
    rate: float
    dispatch: str = SIM_DISPATCH.label()  # a dispatch spec as the axis names it: ``name[:k=v...]``

    @property
    def label(self) -> str:
        return run_label(self.policy, self.dispatch)


def dispatch_options(base: SimOptions, spec: str) -> SimOptions:
    """``base`` running the dispatch spec ``spec`` (``name[:key=value...]``): its values
    over the command line's ``--dispatch-param`` (``base.dispatch``'s values; they apply to
    every order but ``immediate``, which takes none)."""
    d = DispatchSpec.parse(spec)
    if d.order != "immediate":
        d = DispatchSpec.parse(spec, base=base.dispatch)
    return base.override(dispatch=d)


@dataclass
class Outcome:
    job: Job
    row: dict
    ttft_q: list[float]
    imb_q: list[float]


def quantiles(vals: Iterable[float], n: int) -> list[float]:
    """``n + 1`` evenly spaced quantiles (0..1) of ``vals`` (empty list if none)."""
    s = sorted(v for v in vals if v is not None and math.isfinite(v))
    if not s:
        return []
    out = []
    for k in range(n + 1):
        x = (len(s) - 1) * k / n
        lo = int(x)
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (x - lo))
    return out


def validate_setting(base: SimOptions, s: Setting, policy: str, dispatch: str = SIM_DISPATCH.label()) -> None:
    """Raise ValueError for a nonsensical setting or parameter (before any work starts)."""
    from stack.policies import PolicyContext, make_policy

    cfg = setting_options(dispatch_options(base, dispatch), s).sim_config(s.params_for(policy, base.params))
    make_policy(
        policy, PolicyContext(cost=cfg.hardware.cost, slo=cfg.slo, block_size=64), **cfg.policy_params
    )


def run_one(
    trace: Trace, base: SimOptions, settings: tuple[Setting, ...], job: Job, experiment: str
) -> Outcome:
    s = settings[job.setting]
    cfg = setting_options(dispatch_options(base, job.dispatch), s).sim_config(
        s.params_for(job.policy, base.params)
    )
    spec = base.load_spec(trace, job.rate)
    res = make_simulator(trace, job.policy, cfg, spec).run()
    mode = spec.mode
    row = {
        "experiment": experiment,
        **s.columns(),
        "rate": job.rate,
        "rate_unit": "sessions/s" if mode == "sessions" else "x time compression",
        "slo_b": cfg.slo.b,
        "slo_a_ms_per_1k": cfg.slo.a * 1e6,
        **res.metrics,
    }
    return Outcome(job, row, quantiles(res.ttfts, N_TTFT_Q), quantiles(res.imbalance, N_IMB_Q))


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1
