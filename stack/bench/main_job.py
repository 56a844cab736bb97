"""The main job's simulated side (`smetric demo-live`): the question at the scale where it has an
answer, and the bands a live run at the small scale is held to.

- :func:`cluster_scale`: the product against the baselines as their authors ship them, on the
  full agentic trace at cluster scale (32 H20 instances, 8 h of sessions), over a few seeds;
- :func:`seed_figures`: every policy of the main job on its own small workload over
  ``seeds`` seeds (the bands, :mod:`stack.replay.bands`);
- :func:`perturbed_figures`: the same run perturbed (the chaos floor).

Every run is the simulator; nothing here starts a process but, for the cluster scale, a pool
of simulator workers. How the defaults were chosen: docs/research/fidelity.md, "The main job".
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from typing import Any

from stack.bench.live import simulate_pool
from stack.dispatch import ROUTER_DISPATCH, SIM_DISPATCH, DispatchSpec

#: the figures a band is kept for
BAND_FIGURES = ("prefill_tps_within_slo", "slo_attainment", "ttft_p99", "over_5x_slo")
#: the product (smetric-global behind the router's default dispatch, ROUTER_DISPATCH:
#: docs/research/dispatch.md, "The default") against LMetric as its authors ship it, live
DEFAULT_POLICIES = (f"smetric-global+{ROUTER_DISPATCH.label()}", "lmetric")
#: compared in the simulator beside the live policies (at the main job's scale)
SIM_BASELINES = ("least-load",)
#: the rates the knee is searched over (session starts per modelled second)
KNEE_RATES = tuple(round(0.01 * i, 2) for i in range(2, 61))
HARDWARE, HBM = "h20", 200_000  # configs/local.yaml's emulator calibration and cache room


def dispatch_of(spec: str) -> tuple[str, DispatchSpec]:
    """``policy`` or ``policy+order[:k=v...]`` as (policy, its dispatch spec); a bare policy
    runs without a queue (the simulator's default, ``immediate``), live and simulated."""
    from stack.bench.experiments import split_policy

    policy, order = split_policy(spec)
    return policy, SIM_DISPATCH if order is None else DispatchSpec.parse(order)


def sim_run(args: argparse.Namespace, spec: str, trace, hardware: str, hbm: int | None, **load: Any) -> dict:
    """One simulated run of ``spec`` on the main job's pool (``args.prefill`` instances),
    with the session load of ``args`` changed by ``load`` (seed, session_rate; perturb)."""
    policy, dispatch = dispatch_of(spec)
    perturb = load.pop("perturb", None)
    a = argparse.Namespace(**{**vars(args), **load})
    return simulate_pool(a, trace, policy, hardware, hbm, perturb, dispatch=dispatch)


def seed_figures(
    args: argparse.Namespace,
    policies: Sequence[str],
    trace,
    seeds: Sequence[int],
    hardware: str,
    hbm: int | None,
) -> dict[str, list[dict]]:
    """Per policy, the metrics of one simulated run per seed (same seeds for every policy)."""
    return {p: [sim_run(args, p, trace, hardware, hbm, seed=s) for s in seeds] for p in policies}


def perturbed_figures(
    args: argparse.Namespace, policies: Sequence[str], trace, n: int, hardware: str, hbm: int | None
) -> dict[str, list[dict]]:
    """Per policy, ``n`` runs of the run's own seed, each under another perturbation."""
    return {p: [sim_run(args, p, trace, hardware, hbm, perturb=k) for k in range(n)] for p in policies}


@dataclasses.dataclass(frozen=True)
class ScaleSettings:
    """The cluster-scale question (docs/research/dispatch.md's default cluster, at its knee)."""

    trace: str
    instances: int = 32
    hardware: str = "h20"
    session_rate: float = 0.14  # the agentic knee of that cluster (docs/research/dispatch.md)
    duration: float = 28800.0  # 8 h of sessions; the first 5 h warm the cluster up
    seeds: tuple[int, ...] = (0, 1, 2)
    baselines: tuple[str, ...] = ("least-load", "lmetric", "dynamo")


def _scale_one(task: tuple[ScaleSettings, str, int]) -> tuple[str, int, dict]:
    s, spec, seed = task
    from stack.sim.engine import make_simulator
    from stack.sim.options import SimOptions
    from stack.traces.load import load_trace

    policy, dispatch = dispatch_of(spec)
    opts = SimOptions(
        trace=s.trace,
        instances=s.instances,
        hardware=s.hardware,
        session_rate=s.session_rate,
        duration=s.duration,
        seed=seed,
        dispatch=dispatch,
    )
    trace = _trace_cache.get(s.trace) or _trace_cache.setdefault(s.trace, load_trace(s.trace))
    res = make_simulator(trace, policy, opts.sim_config(), opts.load_spec(trace)).run()
    return spec, seed, res.metrics


_trace_cache: dict[str, Any] = {}


def cluster_scale(
    s: ScaleSettings, product: str, jobs: int = 2, progress: Callable[[int, int], None] | None = None
) -> dict[str, list[dict]]:
    """Per policy (the product, then the baselines), its metrics on each seed of ``s``."""
    tasks = [(s, p, seed) for p in (product, *s.baselines) for seed in s.seeds]
    out: dict[str, dict[int, dict]] = {p: {} for p in (product, *s.baselines)}
    with ExitStack() as stack:
        run = map if jobs <= 1 else stack.enter_context(ProcessPoolExecutor(jobs)).map
        for done, (spec, seed, m) in enumerate(run(_scale_one, tasks), 1):
            out[spec][seed] = m
            if progress:
                progress(done, len(tasks))
    return {p: [by_seed[k] for k in s.seeds] for p, by_seed in out.items()}


__all__ = [
    "BAND_FIGURES",
    "DEFAULT_POLICIES",
    "HARDWARE",
    "HBM",
    "KNEE_RATES",
    "SIM_BASELINES",
    "ScaleSettings",
    "cluster_scale",
    "dispatch_of",
    "perturbed_figures",
    "seed_figures",
    "sim_run",
]
