"""`smetric headroom`: where the prompt tokens that miss their TTFT SLO go, and how far each
policy is from an upper bound tighter than the clairvoyant one.

Example (the docs/research/results.md "Headroom" table)::

    smetric headroom --trace stack/data/claude_code_agentic.jsonl.gz \\
        --policies least-load,lmetric,smetric-global,smetric-global+slack:T=4 \\
        --rates 0.13,0.14 --jobs 2 --out out/headroom

Each policy x rate is one simulation that records every measured request's timeline
(router hold, global-tier fetch wait, instance queueing, own compute). A request that
misses its SLO gives its prompt tokens to one or more causes:

  infeasible  its own compute (and own fetch) on an idle instance already exceeds its SLO
  fetch       waiting behind other transfers on its link (beyond its own transfer time)
  queue       queued behind other work at its instance
  imbalance   the part of that queueing the least loaded instance would not have imposed
              when it was placed (all of it when an instance was idle)
  router      held in the router's dispatch queue

(a feasible missed request's tokens are split over the last four in proportion to their
seconds; the cause with the most seconds alone is reported too, as dominant_*). Bounds:
clairvoyant (stack/bench/bound.py: perfect balance, ideal reuse, no queueing; within SLO),
and the window bound of each run: an LP over the run's own arrivals in which the
cluster is one pooled machine and the requests met inside every interval of a family
(5 s to 2560 s) must fit in its capacity; tighter_bound is the smaller of the two. Both are
true bounds; the definitions and the proof are in stack/sim/headroom.py.

Writes DIR/headroom.json (one row per run, every figure) and DIR/headroom.md (the table),
and prints the table. Rates as in `smetric bench`: sessions/s (sessions mode) or
time-compression factors (compress mode). A policy+order entry (smetric-global+slack:T=4)
runs that policy behind that dispatch order.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from stack.bench.experiments import parse_policies, parse_rates, split_policy
from stack.commands.simopts import add_cluster_arguments, add_dispatch_arguments, add_load_arguments
from stack.sim.headroom import CAUSES, DEFAULT_LENGTHS
from stack.sim.options import SimOptions

_TRACE_CACHE: dict[str, Any] = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument(
        "--policies",
        default="least-load,lmetric,smetric-global,smetric-global+slack:T=4",
        help="comma-separated policies; an entry policy+order[:k=v] runs that policy behind "
        "that dispatch order (others use --dispatch)",
    )
    p.add_argument(
        "--rates",
        required=True,
        help="comma-separated rates: sessions/s (sessions mode) or time-compression factors (compress mode)",
    )
    p.add_argument("--jobs", type=int, default=1, help="parallel simulations (worker processes)")
    p.add_argument("--out", default=None, help="output directory for headroom.json and headroom.md")
    p.add_argument(
        "--lengths",
        default=",".join(f"{x:g}" for x in DEFAULT_LENGTHS),
        help="interval lengths of the window bound, seconds (each at offsets of half its length)",
    )
    p.add_argument("--no-bound", action="store_true", help="skip the window bound (attribution only)")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also run the greedy offline schedule on each run's arrivals (stack/sim/oracle.py): "
        "achievable under its simplifications, not a bound",
    )
    p.add_argument(
        "--records",
        action="store_true",
        help="also write each run's per-request records (DIR/records/LABEL@RATE.json.gz; fields: "
        "stack.sim.headroom.RECORD_FIELDS)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cluster_arguments(p)
    add_dispatch_arguments(p)
    add_load_arguments(p, rate=False)


def _lengths(text: str) -> tuple[float, ...]:
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--lengths: {part!r} is not a number") from None
        if not v > 0 or v == float("inf"):
            raise ValueError(f"--lengths: every length must be > 0 and finite, got {part!r}")
        out.append(v)
    if not out:
        raise ValueError("--lengths: empty list")
    return tuple(out)


def _trace(opts: SimOptions) -> tuple[Any, list[int]]:
    from stack.bench.bound import ideal_hits

    key = f"{opts.trace}|{opts.fmt}|{opts.shared_prefix}"
    if key not in _TRACE_CACHE:
        tr = opts.read_trace()
        _TRACE_CACHE[key] = (tr, ideal_hits(tr))
    return _TRACE_CACHE[key]


def run_one(
    opts: SimOptions,
    spec: str,
    rate: float,
    lengths: tuple[float, ...] | None,
    records: str | None = None,
    oracle: bool = False,
) -> dict:
    """One policy spec (``policy`` or ``policy+order``) at one rate: its headroom row
    (``records``: a directory to write its per-request records to)."""
    from stack.bench.bound import clairvoyant
    from stack.bench.runner import dispatch_options
    from stack.sim.headroom import run_headroom

    policy, order = split_policy(spec)
    if order is not None:
        opts = dispatch_options(opts, order)
    trace, ideal = _trace(opts)
    cfg = opts.sim_config()
    load = opts.load_spec(trace, rate)
    cb = clairvoyant(trace, cfg.hardware, cfg.instances, load.mode, load.duration, ideal, cfg.slo)
    keep: list | None = [] if records else None
    row = run_headroom(
        trace, policy, cfg, load, ideal, cb.prefill_tps_within_slo, lengths, keep=keep, oracle=oracle
    )
    if records:
        import gzip

        d = Path(records)
        d.mkdir(parents=True, exist_ok=True)
        with gzip.open(d / f"{spec.replace(':', '_')}@{rate:g}.json.gz", "wt") as f:
            json.dump(keep, f)
    row["label"] = spec
    row["rate"] = rate
    row["seed"] = opts.seed
    row["clairvoyant_tps"] = cb.prefill_tps
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of headroom rows (k tok/s; shares of the missed tokens)."""
    head = (
        "| policy | rate | TPS in SLO (k) | P99 TTFT s | >5x SLO | clairvoyant (k) | window bound (k) "
        "| of tighter bound | oracle (k) | missed (k) | " + " | ".join(CAUSES[:-1]) + " |"
    )
    lines = [head, "|" + "---|" * (10 + len(CAUSES) - 1)]
    for r in rows:
        tb = r.get("tighter_bound_tps")
        cells = [
            r["label"],
            f"{r['rate']:g}",
            f"{r['prefill_tps_within_slo'] / 1e3:.1f}",
            f"{r['ttft_p99']:.1f}",
            f"{100 * r['over_5x_slo']:.2f}%",
            f"{r['clairvoyant_within_slo'] / 1e3:.0f}",
            f"{r['window_bound_tps'] / 1e3:.1f}" if "window_bound_tps" in r else "-",
            f"{100 * r['prefill_tps_within_slo'] / tb:.1f}%" if tb else "-",
            f"{r['oracle_tps_within_slo'] / 1e3:.1f}" if "oracle_tps_within_slo" in r else "-",
            f"{r['missed_tps'] / 1e3:.1f}",
        ]
        cells += [
            f"{r[f'missed_{c}_tps'] / 1e3:.1f} ({100 * r[f'missed_{c}_share']:.0f}%)" for c in CAUSES[:-1]
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _execute(jobs: list[tuple], n_jobs: int, progress: bool) -> list[dict]:
    rows: list[dict] = []
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task(f"headroom: {len(jobs)} simulations", total=len(jobs))
    try:
        if n_jobs == 1:
            for j in jobs:
                rows.append(run_one(*j))
                if bar is not None:
                    bar.advance(task)
        else:
            with ProcessPoolExecutor(max_workers=n_jobs) as ex:
                futs = [ex.submit(run_one, *j) for j in jobs]
                for f in as_completed(futs):
                    rows.append(f.result())
                    if bar is not None:
                        bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    order = {(j[1], j[2]): i for i, j in enumerate(jobs)}
    rows.sort(key=lambda r: order[(r["label"], r["rate"])])
    return rows


def run(args: argparse.Namespace) -> int:
    from stack.bench.runner import dispatch_options

    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    specs = parse_policies(args.policies, ())
    rates = parse_rates(args.rates) or []
    lengths = None if args.no_bound else _lengths(args.lengths)
    opts = SimOptions.from_args(args)
    trace, _ = _trace(opts)
    for spec in specs:  # fail on a bad option before any simulation runs
        _, order = split_policy(spec)
        o = opts if order is None else dispatch_options(opts, order)
        o.sim_config()
        o.load_spec(trace, rates[0])
    rec = str(Path(args.out) / "records") if args.records and args.out else None
    if args.records and not args.out:
        raise ValueError("--records needs --out")
    jobs = [(opts, s, r, lengths, rec, args.oracle) for s in specs for r in rates]
    progress = not args.no_progress and sys.stderr.isatty()
    rows = _execute(jobs, args.jobs, progress)
    md = table(rows)
    print(md, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "headroom.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
        (out / "headroom.md").write_text(md)
        print(f"wrote {out / 'headroom.json'} and {out / 'headroom.md'}", file=sys.stderr)
    return 0
