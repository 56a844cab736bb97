"""`smetric demo-live` from end to end: validate, the simulated parts, the live runs, the report.

The steps (the command's docstring says what each means):

1. :func:`validate` the options (a ValueError names the bad one);
2. the knee of the local cluster (:func:`choose_knee`), unless ``--session-rate``;
3. the cluster-scale comparison (:func:`stack.bench.main_job.cluster_scale`);
4. the bands over seeds and the chaos floor at the main job's scale;
5. the live runs (:func:`stack.bench.main_job_live.live_one`);
6. the tables, the verdict and the JSON (:func:`report`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from stack.bench import main_job as MJ
from stack.bench import main_job_report as R
from stack.bench.live import fmt_cell
from stack.paths import repo_relative
from stack.replay import bands as B
from stack.replay import fidelity

#: the width the report is laid out for when not on a terminal (a log, a pipe, CI)
REPORT_WIDTH = 100

ROWS = [
    ("prefill_tps_within_slo", "prefill TPS within SLO", "{:,.0f}"),
    ("slo_attainment", "SLO attainment", "{:.1%}"),
    ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
    ("ttft_p90", "TTFT p90 (s)", "{:.2f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.1f}"),
    ("over_5x_slo", "past 5x SLO", "{:.1%}"),
    ("queue_wait_mean", "queue wait mean (s)", "{:.2f}"),
]


def validate(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The live policies and the simulated-only baselines; ValueError on a bad option."""
    from stack.policies import POLICIES

    if args.long:
        args.duration = max(args.duration, 1800.0)
        args.seeds = max(args.seeds, 20)
        args.perturbations = max(args.perturbations, 20)
        args.scale_seeds = max(args.scale_seeds, 5)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    extra = [x.strip() for x in (args.sim_baselines or "").split(",") if x.strip()]
    for pol in policies + extra:
        name, dispatch = MJ.dispatch_of(pol)  # ValueError on an unknown order or parameter
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        dispatch.to_config()  # ValueError where the router cannot run it (replicas)
    if not policies:
        raise ValueError("--policies: name at least one policy")
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1 (got {args.repeat})")
    if args.prefill < 1 or args.decode < 1 or args.workers_per_process < 1:
        raise ValueError("--prefill, --decode and --workers-per-process must be >= 1")
    if args.seeds < B.MIN_SEEDS or args.perturbations < B.MIN_SEEDS:
        raise ValueError(
            f"--seeds and --perturbations must be >= {B.MIN_SEEDS} (a band's 10th-90th percentile)"
        )
    if args.scale_seeds < 1 or args.scale_jobs < 1:
        raise ValueError("--scale-seeds and --scale-jobs must be >= 1")
    return policies, [p for p in extra if p not in policies]


def choose_knee(args: argparse.Namespace, policies: list[str], trace) -> fidelity.Knee:
    """The knee of the local cluster, by the simulator: baselines are the policies compared
    other than the SMetric family (all of them when that leaves none)."""
    from stack.policies import is_smetric

    baselines = [p for p in policies if not is_smetric(MJ.dispatch_of(p)[0])] or policies

    def att(policy: str, rate: float) -> float:
        v = MJ.sim_run(args, policy, trace, MJ.HARDWARE, MJ.HBM, session_rate=rate).get("slo_attainment")
        return float(v) if v is not None else 0.0

    return fidelity.knee_rate(att, baselines, MJ.KNEE_RATES, args.knee_share)


def _say(console, show: bool, text: str) -> None:
    if show:
        console.print(text)


def run_main_job(args: argparse.Namespace) -> int:
    from rich.console import Console

    from stack.traces.load import load_trace

    policies, extra = validate(args)
    trace = load_trace(args.trace)
    show = not args.no_progress and sys.stderr.isatty()
    # a terminal's own width; otherwise 100 columns (the report is written to fit them)
    console = Console() if sys.stdout.isatty() else Console(width=REPORT_WIDTH)
    err = Console(stderr=True)
    doc: dict = {"settings": None, "knee": None}
    knee = None
    if args.session_rate is None:
        knee = choose_knee(args, policies, trace)
        args.session_rate = knee.rate
        console.print(
            f"knee (simulator, {args.prefill} instances): {knee.rate} sessions/s, where {knee.baseline} "
            f"attains {knee.attainment:.1%} (target {knee.target:.1%} = {args.knee_share:.0%} of its "
            f"light-load {knee.ceiling:.1%})"
        )
    scale = None
    if not args.no_sim and not args.no_scale:
        s = MJ.ScaleSettings(trace=str(_full_trace()), seeds=tuple(range(args.scale_seeds)))
        _say(err, show, f"cluster scale: {len(s.seeds) * (1 + len(s.baselines))} simulations of 32 instances")
        scale = MJ.cluster_scale(s, policies[0], args.scale_jobs)
        doc["scale"] = {"settings": vars(s), "runs": scale}
    seeds = list(range(args.seeds))
    seed_runs = perturbed = None
    if not args.no_sim:
        seed_runs = MJ.seed_figures(args, policies + extra, trace, seeds, MJ.HARDWARE, MJ.HBM)
        perturbed = MJ.perturbed_figures(args, policies, trace, args.perturbations, MJ.HARDWARE, MJ.HBM)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    if not args.no_live:
        from stack.bench.main_job_live import live_one

        for i in range(args.repeat):
            for pol in policies:
                label = f"live {pol}" + (f" {i + 1}/{args.repeat}" if args.repeat > 1 else "")
                runs[pol].append(live_one(args, pol, trace, show, label))
    sims: dict[str, dict] | None = None
    if not args.no_sim:
        sims = {}
        for pol in policies:
            first = runs[pol][0] if runs[pol] else {}
            sims[pol] = MJ.sim_run(
                args, pol, trace, first.get("hardware") or MJ.HARDWARE, first.get("capacity_tokens") or MJ.HBM
            )
    report(args, console, policies, extra, knee, scale, seed_runs, perturbed, runs, sims, doc)
    return 0


def _full_trace() -> Path:
    from stack.traces.shipped import shipped

    return shipped("claude_code_agentic")


def report(args, console, policies, extra, knee, scale, seed_runs, perturbed, runs, sims, doc) -> None:
    """Print the tables and the verdict, each policy by its short name (the product as
    ``product``, its label once, in the legend); write the JSON (``--out``)."""
    product = policies[0]
    names = R.display_names([*policies, *extra, *(scale or {})], MJ.DEFAULT_POLICIES[0])
    show = R.renamer(names)
    for line in R.legend(names):
        console.print(line, soft_wrap=True)
    claim = R.scale_claim(product, scale) if scale else None
    if claim is not None:
        console.print(_scale_table(scale, claim, names))
        console.print(show(claim.sentence()))
    comparisons: list[B.Comparison] = []
    floors: dict[str, float] = {}
    if seed_runs is not None:
        for other in [p for p in policies[1:] + extra]:
            comparisons.append(B.compare(product, R.tps(seed_runs[product]), other, R.tps(seed_runs[other])))
        floors = {p: B.chaos_floor(R.tps(perturbed[p])) for p in perturbed}
        console.print(_band_table(args, seed_runs, floors, names))
        for c in comparisons:
            console.print(show(c.sentence()))
    live = {p: fidelity.spread(R.tps(rs)).mean for p, rs in runs.items() if rs}
    checks: list[R.LiveCheck] = []
    claims: list[tuple[B.Comparison, str | None, bool]] = []
    summary = {p: fidelity.summarize_runs(runs[p], sims[p] if sims else None) for p in policies if runs[p]}
    if live:
        console.print(_live_table(args, policies, runs, sims, summary, names))
        if sims and seed_runs is not None:
            checks = R.live_checks(
                live, {p: float(sims[p].get(R.KEY) or 0.0) for p in live}, seed_runs, floors
            )
            for ch in checks:
                console.print(
                    f"{names[ch.policy]}: live {ch.live:,.0f} against its model {ch.sim:,.0f} ({ch.gap:+.1%}); band "
                    f"{ch.band.p10:,.0f}-{ch.band.p90:,.0f} widened by the chaos floor {ch.floor:.1%}: "
                    f"{'inside' if ch.inside else 'OUTSIDE'}"
                )
            for c in comparisons:
                if c.b in live and c.a in live and live[c.b]:
                    fl = max(floors.get(c.a, 0.0), floors.get(c.b, 0.0))
                    who, agree = B.live_claim(c, live[c.a] / live[c.b], fl)
                    claims.append((c, who, agree))
                    console.print(
                        show(
                            f"live: {c.a} / {c.b} = x{live[c.a] / live[c.b]:.3f} "
                            f"({'winner ' + who if who else 'within the chaos floor of a tie'}): "
                            f"{'agrees with' if agree else 'DISAGREES with'} the model"
                        )
                    )
        _warn_clock(console, runs, names)
    line = show(R.verdict(claim, comparisons, claims, checks, args.prefill))
    doc["names"] = names
    console.print(line)
    if args.out:
        _write(
            args,
            doc,
            knee,
            seed_runs,
            perturbed,
            floors,
            comparisons,
            checks,
            summary,
            runs,
            sims,
            line,
            console,
        )


def _scale_table(scale: dict[str, list[dict]], claim: R.ScaleClaim, names: dict[str, str]):
    from rich.table import Table

    t = Table(
        title="cluster scale (simulated): 32 H20 instances, the 470-session agentic trace, 8 h of sessions"
    )
    for col in (
        "policy",
        "TPS within SLO (mean, min-max over seeds)",
        "x product per seed",
        "P99 TTFT",
        "past 5x",
    ):
        t.add_column(col, justify="right" if col != "policy" else "left")
    prod = R.tps(scale[claim.product])
    for p, rs in scale.items():
        v = R.tps(rs)
        rat = "" if p == claim.product else " ".join(f"x{a / b:.3f}" for a, b in zip(prod, v, strict=True))
        t.add_row(
            names.get(p, p),
            f"{sum(v) / len(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})",
            rat,
            f"{sum(r.get('ttft_p99') or 0 for r in rs) / len(rs):.1f} s",
            f"{sum(r.get('over_5x_slo') or 0 for r in rs) / len(rs):.2%}",
        )
    return t


def _band_table(args, seed_runs: dict[str, list[dict]], floors: dict[str, float], names: dict[str, str]):
    from rich.table import Table

    t = Table(
        title=f"the main job's scale (simulated): {args.prefill} instances, {Path(args.trace).name}, "
        f"{args.session_rate} sessions/s, {len(next(iter(seed_runs.values())))} seeds"
    )
    for col in ("policy", "TPS within SLO p10 / median / p90", "band", "chaos floor", "P99 TTFT", "past 5x"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for p, rs in seed_runs.items():
        b = B.band(R.tps(rs))
        t.add_row(
            names.get(p, p),
            f"{b.p10:,.0f} / {b.median:,.0f} / {b.p90:,.0f}",
            f"±{b.half_width:.0%}",
            f"±{floors[p]:.1%}" if p in floors else "-",
            f"{B.band([r.get('ttft_p99') or 0 for r in rs]).median:.1f} s",
            f"{B.band([r.get('over_5x_slo') or 0 for r in rs]).median:.2%}",
        )
    return t


def _live_table(args, policies, runs, sims, summary, names):
    from rich.table import Table

    t = Table(
        title=f"live: {Path(args.trace).name}, {args.prefill} prefill + {args.decode} decode emulated workers, "
        f"{args.session_rate} sessions/s for {args.duration:.0f} s (modelled), seed {args.seed}, "
        f"{args.repeat} run(s) per policy"
    )
    t.add_column("figure", no_wrap=True)
    live_pols = [p for p in policies if runs[p]]
    for pol in live_pols:
        t.add_column(f"{names[pol]}\nlive", justify="right")
        if sims:
            t.add_column(f"{names[pol]}\nsim", justify="right")
            t.add_column(f"{names[pol]}\nlive/sim", justify="right")
    for key, head, f in ROWS:
        row = [head]
        for pol in live_pols:
            if key == "queue_wait_mean":
                vals = [(r.get("queue") or {}).get("queue_wait_mean") for r in runs[pol]]
                lv = fidelity.spread(vals).mean
                sv = sims[pol].get(key) if sims else None
                row.append(fmt_cell(lv, f))
                if sims:
                    row += [fmt_cell(sv, f), fmt_cell(fidelity.gap(lv, sv), "{:+.0%}")]
                continue
            s = {**summary[pol][key], "runs": summary[pol]["runs"]}
            row.append(_pm(s, f))
            if sims:
                row += [fmt_cell(s["sim"], f), fmt_cell(s["gap"], "{:+.0%}")]
        t.add_row(*row)
    row = ["requests measured / errors"]
    for pol in live_pols:
        row.append(" / ".join(str(r.get("requests")) for r in runs[pol]) + f" / {summary[pol]['errors']}")
        if sims:
            row += [str(sims[pol].get("requests")), ""]
    t.add_row(*row)
    return t


def _pm(s: dict, f: str) -> str:
    """live mean (+-spread%) over the repeats."""
    m = fmt_cell(s["live_mean"], f)
    if s["live_spread"] is None or s.get("runs", 2) < 2:
        return m
    return f"{m} ±{s['live_spread']:.0%}"


def _warn_clock(console, runs, names) -> None:
    behind = {p: sum(r["model_clock"]["resyncs"] for r in rs) for p, rs in runs.items() if rs}
    if any(behind.values()):
        console.print(
            "[yellow]the emulator fell behind its modelled clock "
            + ", ".join(f"{names.get(p, p)}: {n} times" for p, n in behind.items())
            + ": host CPU is short for this time factor; figures are stretched (raise --time-factor)[/]"
        )


def _write(
    args, doc, knee, seed_runs, perturbed, floors, comparisons, checks, summary, runs, sims, line, console
):
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc.update(
        {
            "settings": {
                k: (repo_relative(v) if k in ("trace", "out") and v else v)
                for k, v in vars(args).items()
                if k not in ("func",)
            },
            "knee": vars(knee) if knee else None,
            "bands": {
                p: {k: B.band([r.get(k) or 0.0 for r in rs]).as_dict() for k in MJ.BAND_FIGURES}
                for p, rs in (seed_runs or {}).items()
            },
            "band_seeds": list(range(args.seeds)) if seed_runs else [],
            "chaos_floor": floors,
            "perturbed": {p: R.tps(rs) for p, rs in (perturbed or {}).items()},
            "comparisons": [
                {"a": c.a, "b": c.b, "ratio": c.ratio.as_dict(), "winner": c.winner} for c in comparisons
            ],
            "live_checks": [
                {"policy": ch.policy, "live": ch.live, "sim": ch.sim, "gap": ch.gap, "inside": ch.inside}
                for ch in checks
            ],
            "summary": summary,
            "verdict": line,
            "runs": runs,
            "sim": sims,
        }
    )
    if "scale" in doc:
        doc["scale"]["settings"]["trace"] = repo_relative(doc["scale"]["settings"]["trace"])
    out.write_bytes(
        orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_DATACLASS, default=str) + b"\n"
    )
    console.print(f"wrote {out}")
