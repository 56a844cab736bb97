"""The router's fit under load against lone prefills on the same pool, from recorded runs.

    python benchmarks/learned_under_load.py --quiet Q1 Q2 ... --busy B1 B2 ...

Each argument is an ``--out`` folder of ``benchmarks/sglang_learn.py`` (``observations.jsonl``
and ``cost_model.json``): ``--quiet`` runs one request at a time (``--clients 1``), ``--busy``
runs with several clients. The quiet runs' observations, pooled, are fitted as the router fits
lone prefills (``stack.core.fit.fit_batches``, rows held out by ``held_out``): the reference.
For each busy run it prints the router's own fit (``cost_model.json``) and:

- its price of each quiet prompt size against the quiet runs' median timing of that size;
- the busy run's lone prefills (stretches of one) against the reference's price, and the
  busy fit's error on them;
- each batched stretch's span against the reference's price of its members one by one.

A busy fit far from the quiet timings prices the pool as it ran under that load: whether
that is batching's cost or the host's (on a 2-core machine the router, the clients and the
decode worker share the prefill worker's cores), the last two lines help tell apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from stack.core.cost_model import CostModel
from stack.core.fit import batch_features, fit_batches, held_out
from stack.core.observations import Observation, read_observations
from stack.prefill_router.learned_cost import Held, Ticket, stretches


def observations(run: Path) -> list[Observation]:
    return sorted(read_observations(run / "observations.jsonl"), key=lambda o: o.t)


def groups(obs: list[Observation]) -> list[list[Observation]]:
    """The busy stretches the router's refit groups them into (``learned_cost.stretches``)."""
    held = [Held(o, Ticket(o.worker), 0) for o in obs]
    return [[h.ob for h in g.members] for g in stretches(held)]


def reference(runs: list[Path]) -> tuple[CostModel, dict[int, tuple[float, float]]]:
    """The lone fit of the pooled quiet runs, and each prompt size's median (tokens, seconds)."""
    obs = [o for r in runs for o in observations(r) if o.alone]
    n = np.array([o.new_tokens for o in obs], dtype=float)
    ctx = np.array([o.context for o in obs], dtype=float)
    secs = np.array([o.forward_s for o in obs], dtype=float)
    fit = fit_batches(batch_features(n, ctx, np.arange(len(n)), None), secs, held_out(len(n), 5))
    sizes: dict[int, list[Observation]] = {}
    for o in obs:  # the prompt sizes differ by 3x or more: bucket on the power of 1.5
        sizes.setdefault(round(np.log(o.new_tokens) / np.log(1.5)), []).append(o)
    med = {
        k: (statistics.median(o.new_tokens for o in v), statistics.median(o.forward_s for o in v))
        for k, v in sorted(sizes.items())
    }
    print(
        f"reference: {len(obs)} lone prefills of {len(runs)} quiet runs, held-out MAPE "
        f"{fit.holdout_mape:.1%} (fit {fit.train_mape:.1%}); {fit.cost}"
    )
    return fit.cost, med


def price(m: CostModel, o: Observation) -> float:
    return m.cost(o.new_tokens, o.context)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quiet", nargs="+", type=Path, required=True, help="one-at-a-time runs")
    p.add_argument("--busy", nargs="+", type=Path, required=True, help="runs with several clients")
    a = p.parse_args(argv)
    ref, med = reference(a.quiet)
    for run in a.busy:
        st = json.loads((run / "cost_model.json").read_text())
        fit = st["learned"]
        c = fit["coefficients"]
        busy = CostModel(c["c_linear"], c["c_attn"], c["c_fwd"])
        print(
            f"\n{run}: {fit['rows_fitted']} rows, held-out MAPE {fit['holdout_mape']:.1%}, "
            f"trusted {fit['trusted']}; {busy}"
        )
        over = []
        for n, s in med.values():
            q = busy.cost(n, n)
            over.append(q / s - 1)
            print(f"  {int(n):>6} new tokens: quiet median {1e3 * s:7.1f} ms, busy fit {1e3 * q:7.1f} ms")
        print(f"  busy fit above the quiet medians: mean {np.mean(over):+.0%}")
        busy_groups = groups(observations(run))
        lone = [g[0] for g in busy_groups if len(g) == 1]
        if lone:
            r = [o.forward_s / price(ref, o) for o in lone]
            e = [abs(price(busy, o) - o.forward_s) / o.forward_s for o in lone]
            print(
                f"  {len(lone)} lone prefills in this run: {min(r):.2f}-{max(r):.2f}x the reference's "
                f"price; busy fit's error on them {np.mean(e):.0%}"
            )
        ratios = [
            (max(o.end for o in g) - g[0].t) / sum(price(ref, o) for o in g)
            for g in busy_groups
            if len(g) > 1
        ]
        if ratios:
            print(
                f"  {len(ratios)} batched stretches: span / the reference's price of their members "
                f"median {np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
