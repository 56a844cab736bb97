"""The router's learned-cost fit on recorded observations, scored under two hold-out rules.

    python benchmarks/holdout_rules.py RUN/observations.jsonl [RUN2/observations.jsonl ...]

Reads the observations the router exported (``GET /admin/cost_model/observations``, which
``benchmarks/sglang_learn.py`` writes to ``OUT/observations.jsonl``), keeps the ones marked
``alone``, and fits them one row each, in engine-clock order, as the router's refit does
(``stack.core.fit.fit_batches``). It prints the held-out and fitted MAPE under the rule the
router uses (one row per block of ``--every`` at a varying place, ``stack.core.fit.held_out``)
and under every ``--every``-th row (the rule before 2026-12-07), side by side, and the new-token
counts each rule held out. Traffic that cycles through ``--every`` prompt sizes shows the
difference: every ``--every``-th row is then always the same size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from stack.core.fit import batch_features, fit_batches, held_out
from stack.core.observations import read_observations


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("observations", nargs="+", type=Path, help="JSON-lines files of observations")
    p.add_argument("--every", type=int, default=5, help="holdout_every (default 5, the router's)")
    a = p.parse_args(argv)
    print(f"{'file':<40} {'rows':>4}  {'varying: held-out / fit':>24}  {'every k-th: held-out / fit':>27}")
    for path in a.observations:
        obs = sorted((o for o in read_observations(path) if o.alone), key=lambda o: o.t)
        n = np.array([o.new_tokens for o in obs], dtype=float)
        ctx = np.array([o.context for o in obs], dtype=float)
        secs = np.array([o.forward_s for o in obs], dtype=float)
        feats = batch_features(n, ctx, np.arange(len(n)), None)
        rules = {
            "varying": held_out(len(n), a.every),
            "every": (np.arange(len(n)) + 1) % a.every == 0,
        }
        fits = {k: fit_batches(feats, np.maximum(secs, 1e-9), h) for k, h in rules.items()}
        v, e = fits["varying"], fits["every"]
        print(
            f"{str(path)[-40:]:<40} {len(n):>4}  {v.holdout_mape:>14.1%} / {v.train_mape:>6.1%}"
            f"  {e.holdout_mape:>17.1%} / {e.train_mape:>6.1%}"
        )
        for k, h in rules.items():
            print(f"    {k} holds out new tokens: {sorted(int(x) for x in n[h])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
