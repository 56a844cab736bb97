"""`smetric advise --trace REC`: which router configuration, and how many instances, for the
traffic a router recorded (``router.record``; docs/router.md, "Recording what the router
serves").

The recording is replayed in the simulator (the same policy and dispatch code the router
runs) with the product's default and the baselines, at the recorded load and at growth factors
of it (``--growth``), each over several seeds (``--seeds``). By default (``--load-mode
compress``) the replay keeps the recorded arrivals: every recorded session starts when it did
(sooner by the growth factor), each follow-up after its parent's answer and the recorded think
time, and each seed perturbs that load a little (session starts by up to 1 ms, think times by
up to 1%: the chaos floor). With ``--load-mode sessions`` the recorded sessions start as a
Poisson process at the recorded session rate times the growth factor, one arrival seed each. For each it prints prefill TPS within the TTFT SLO, SLO attainment, P99 TTFT
and the share of requests past 5x their SLO, each as a median with its band (10th-90th
percentile over the seeds; over three seeds, their range). Then it names a configuration: the product's default unless
another policy beats it at every seed, by more than the simulator's chaos floor (1%), at the
recorded rate or the first growth factor where one does (a paired comparison; anything less is
"within noise" and keeps the default),
and prints the router configuration section to use.

``--plan`` answers capacity: for each instance count of ``--plan-instances`` it runs the
recommended configuration and prints, per growth factor, the smallest count whose median SLO
attainment reaches ``--target`` (0.9), with the decode instances the recorded output needs at
the TPOT SLO (decode is sized from the calibration's decode cost, by throughput; the simulator
runs prefill only in PD mode).

Examples::

    smetric advise --trace smetric-record/ --hardware configs/hardware/h20.yaml --instances 8
    smetric advise --trace smetric-record/ --instances 8 --plan --plan-instances 4,8,16
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from stack.bench.experiments import Setting, parse_policies
from stack.commands.simopts import add_cluster_arguments, add_load_arguments
from stack.dispatch import ROUTER_DISPATCH

#: the product's default, as the router ships it
PRODUCT = f"smetric-global+{ROUTER_DISPATCH.label()}"
ADVISE_POLICIES = (PRODUCT, "smetric-global", "least-load", "lmetric", "linear", "dynamo")
#: a policy is named over the default only when it wins by more than this at every seed: the
#: simulator's chaos floor (the spread of one load under tiny perturbations), measured at 8
#: instances at 0.6% to 1.6% (docs/research/fidelity.md); a narrower band over few seeds is no evidence
MIN_MARGIN = 0.01
FIGURES = (
    ("prefill_tps_within_slo", "TPS in SLO (k tok/s)", 1e-3, ".1f"),
    ("slo_attainment", "attainment", 1.0, ".3f"),
    ("ttft_p99", "P99 TTFT (s)", 1.0, ".2f"),
    ("over_5x_slo", ">5x SLO", 100.0, ".2f"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument(
        "--policies", default=None, help=f"comma-separated policies (default: {','.join(ADVISE_POLICIES)})"
    )
    p.add_argument("--seeds", default="0,1,2", help="arrival seeds (at least 3: a band needs them)")
    p.add_argument(
        "--growth",
        default="1,1.25,1.5",
        help="session rates as multiples of the recorded one (1: as recorded)",
    )
    p.add_argument("--plan", action="store_true", help="also size the pool: instances per growth factor")
    p.add_argument("--plan-instances", default="2,4,8,16,32", help="instance counts --plan tries")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment --plan sizes for")
    p.add_argument("--jobs", type=int, default=2, help="parallel worker processes")
    p.add_argument(
        "--out", default=None, help="also write each run's rows (results.csv) under this directory"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cluster_arguments(p)
    add_load_arguments(p, rate=False)
    p.set_defaults(duration=3600.0, load_mode="compress")


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ValueError(f"{what}: expected positive numbers, got {text!r}")
    return out


def _sweep(args, policies, rates, seeds, out: Path | None, tag: str) -> dict:
    """Rows of every (policy, rate) run per seed: {(policy, rate): [row per seed]}."""
    from stack.bench.summary import row_label
    from stack.bench.sweep import run_bench

    got: dict[tuple[str, float], list[dict]] = {}
    for seed in seeds:
        a = argparse.Namespace(**vars(args))
        a.seed = seed
        if args.load_mode == "compress":  # the recorded arrivals, perturbed by each seed
            a.perturb = seed
        res = run_bench(
            a,
            experiment="advise",
            settings=(Setting(),),
            policies=policies,
            rates=rates,
            out=None if out is None else out / f"{tag}seed{seed}",
            jobs=args.jobs,
            plots=False,
            progress=not args.no_progress and sys.stderr.isatty(),
            command="smetric advise",
        )
        for row in res["rows"]:
            got.setdefault((row_label(row), round(float(row["rate"]), 9)), []).append(row)
    return got


def _fig(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) if r.get(key) not in (None, "") else math.nan for r in rows]


def _cell(rows: list[dict], key: str, scale: float, spec: str) -> str:
    from stack.replay.bands import band

    xs = [x * scale for x in _fig(rows, key) if math.isfinite(x)]
    if len(xs) < 3:
        return "-"
    b = band(xs, min_n=3)
    return f"{b.median:{spec}} [{b.p10:{spec}}-{b.p90:{spec}}]"


def recommend(got: dict, policies: tuple[str, ...], rates: list[float]) -> tuple[str, str]:
    """(the configuration to run, why): the product's default unless a policy beats it at every
    seed on prefill TPS within SLO (its paired ratio's whole band above 1 + :data:`MIN_MARGIN`),
    at the first rate where any policy does; else the default, within noise."""
    from stack.replay.bands import compare

    for rate in rates:
        base = got.get((PRODUCT, round(rate, 9)))
        if base is None:
            continue
        best = None
        for p in policies:
            if p == PRODUCT or (p, round(rate, 9)) not in got:
                continue
            try:
                c = compare(
                    p,
                    _fig(got[(p, round(rate, 9))], "prefill_tps_within_slo"),
                    PRODUCT,
                    _fig(base, "prefill_tps_within_slo"),
                    min_n=3,
                )
            except ValueError:  # the default served nothing within its SLO there: no ratio
                continue
            if (
                c.winner == p
                and c.ratio.p10 > 1.0 + MIN_MARGIN
                and (best is None or c.ratio.median > best.ratio.median)
            ):
                best = c
        if best is not None:
            return best.a, f"at rate {rate:.4g}: {best.sentence()}"
    return (
        PRODUCT,
        "no policy beats the default at every seed at any rate tried: within noise, the default stays",
    )


def config_section(policy: str) -> str:
    """The router configuration section that runs ``policy`` (``name`` or ``name+dispatch``),
    its dispatch queue written out whole (:meth:`DispatchSpec.to_config`)."""
    import yaml

    from stack.dispatch.spec import DispatchSpec

    name, _, dispatch = policy.partition("+")
    spec = DispatchSpec.parse(dispatch or "immediate")
    return yaml.safe_dump(
        {"router": {"policy": name, "dispatch": spec.to_config()}}, sort_keys=False
    ).rstrip()


def decode_instances(trace, hw, rate_factor: float, tpot_s: float) -> int:
    """Decode instances the recorded output needs at ``rate_factor`` times its rate: the output
    tokens per second over one instance's throughput at the largest batch whose step keeps to
    the TPOT SLO and whose KV fits its HBM (the mean context of the trace)."""
    reqs = trace.requests
    span = max(trace.duration, 1.0)
    demand = rate_factor * sum(r.output_len for r in reqs) / span
    if demand <= 0:
        return 0
    ctx = sum(r.input_len + r.output_len / 2 for r in reqs) / len(reqs)
    dc = hw.decode
    best = 0.0
    b = 1
    while b <= 4096 and b * ctx <= hw.hbm_kv_tokens:
        step = dc.step(b, b * ctx)
        if step > tpot_s:
            break
        best = max(best, b / step)
        b *= 2
    if best <= 0:
        return -1
    return math.ceil(demand / best)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from stack.sim.options import SimOptions

    if args.jobs < 1:
        raise ValueError("--jobs must be >= 1")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    if len(set(seeds)) < 3:
        raise ValueError("--seeds: at least 3 (a band needs them)")
    growth = _floats(args.growth, "--growth")
    policies = parse_policies(args.policies, ADVISE_POLICIES)
    if PRODUCT not in policies:
        policies = (PRODUCT, *policies)
    opts = SimOptions.from_args(args)
    trace = opts.read_trace()
    base = trace.base_session_rate()
    compress = opts.resolved_mode(trace) == "compress"
    # compress: the recorded arrivals, time compressed by each factor; sessions: Poisson starts
    rates = [float(g) for g in growth] if compress else [round(base * g, 6) for g in growth]
    out = Path(args.out) if args.out else None
    console = Console(width=None if sys.stdout.isatty() else 170)
    console.print(
        f"{Path(args.trace).name}: {len(trace.requests)} requests in {len(trace.sessions)} sessions, "
        f"recorded rate {base:.4g} sessions/s; {args.instances} instances, {len(seeds)} seeds "
        + ("(the recorded arrivals, each seed a perturbation)" if compress else "(Poisson session starts)")
    )
    got = _sweep(args, policies, rates, seeds, out, "")
    missing = [
        f"{p} @ {r:.4g}" for p in policies for r in rates if len(got.get((p, round(r, 9)), ())) < len(seeds)
    ]
    if missing:
        console.print(f"[red]runs failed, no advice:[/red] {', '.join(missing)}")
        return 1
    t = Table(title="median [10th-90th percentile over seeds]", title_justify="left")
    t.add_column("growth")
    t.add_column("policy", overflow="fold")
    for _, head, _, _ in FIGURES:
        t.add_column(head, justify="right")
    for g, rate in zip(growth, rates, strict=True):
        for p in policies:
            rows = got.get((p, round(rate, 9)))
            if rows:
                t.add_row(f"x{g:g}", p, *(_cell(rows, k, s, f) for k, _, s, f in FIGURES))
    console.print(t)
    choice, why = recommend(got, policies, rates)
    console.print(f"recommended: {choice}\n  {why}\n")
    print(config_section(choice))
    if args.plan:
        plan(args, choice, growth, rates, seeds, trace, out, console)
    return 0


def plan(args, choice: str, growth, rates, seeds, trace, out, console) -> None:
    """The smallest instance count of ``--plan-instances`` whose median SLO attainment reaches
    ``--target`` at each growth factor, and the decode instances beside it."""
    from rich.table import Table

    from stack.core.cost_model import load_hardware
    from stack.replay.bands import band

    counts = sorted(int(x) for x in _floats(args.plan_instances, "--plan-instances"))
    hw = load_hardware(args.hardware)
    tpot = args.slo_tpot if getattr(args, "slo_tpot", None) else hw.decode_tpot_s
    need: dict[float, int | None] = dict.fromkeys(rates)
    for n in counts:
        a = argparse.Namespace(**vars(args))
        a.instances = n
        got = _sweep(a, (choice,), [r for r in rates if need[r] is None], seeds, out, f"plan{n}-")
        for r in rates:
            rows = got.get((choice, round(r, 9)))
            if need[r] is None and rows and band(_fig(rows, "slo_attainment"), min_n=3).median >= args.target:
                need[r] = n
        if all(v is not None for v in need.values()):
            break
    t = Table(title=f"capacity: {choice}, SLO attainment >= {args.target:g}", title_justify="left")
    for h in ("growth", "sessions/s", "prefill instances", "decode instances (TPOT)", "P:D"):
        t.add_column(h, justify="right")
    base = trace.base_session_rate()
    for g, r in zip(growth, rates, strict=True):
        n = need[r]
        d = decode_instances(trace, hw, g, tpot)
        pre = str(n) if n is not None else f"> {counts[-1]}"
        ratio = f"{n}:{d}" if n is not None and d > 0 else "-"
        t.add_row(f"x{g:g}", f"{base * g:.4g}", pre, str(d) if d >= 0 else "TPOT unreachable", ratio)
    console.print(t)
