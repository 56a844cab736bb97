"""`smetric demo-live`: the main job over the real HTTP path, beside its model.

Brings up the local PD stack (``smetric up``: mooncake_master, emulated prefill and decode
workers sharing a few processes, the router) once per policy and repeat, replays a slice of
the shipped agentic trace through the router with ``smetric replay``'s load model, and prints
per policy the live figures (mean and run-to-run spread over ``--repeat``) beside the
simulator's for the same trace, load, instance count and calibration, then a one-line verdict.
Everything started is stopped again (also on Ctrl-C).

Defaults: 8 prefill + 2 decode workers, the session rate at the knee of the local cluster
(chosen by the simulator first: the highest rate at which the best baseline keeps 90% of its
light-load SLO attainment), 600 modelled seconds of arrivals (about 350-400 measured requests
per policy), time factor 0.3 (about 7 minutes per policy on 2 cores). Times are modelled
seconds (wall seconds / the emulator's time factor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from stack.bench.live import add_window_arguments, fmt_cell, pool_replay_config, simulate_pool
from stack.dispatch import ROUTER_DISPATCH, SIM_DISPATCH, DispatchSpec
from stack.paths import default_trace, repo_relative
from stack.replay import fidelity

ROWS = [
    ("prefill_tps_within_slo", "prefill TPS within SLO", "{:,.0f}"),
    ("slo_attainment", "SLO attainment", "{:.1%}"),
    ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
    ("ttft_p90", "TTFT p90 (s)", "{:.2f}"),
    ("ttft_p99", "TTFT p99 (s)", "{:.1f}"),
    ("over_5x_slo", "past 5x SLO", "{:.1%}"),
]
KNEE_RATES = tuple(round(0.01 * i, 2) for i in range(2, 31))
HARDWARE, HBM = "h20", 200_000  # configs/local.yaml's emulator calibration and cache room
#: the product (smetric-global behind the router's default dispatch, ROUTER_DISPATCH:
#: slack, readiness 4 s; docs/dispatch.md, "The default") against the best baseline as its
#: authors ship it
DEFAULT_POLICIES = (f"smetric-global+{ROUTER_DISPATCH.label()}", "lmetric")


def dispatch_of(spec: str) -> tuple[str, DispatchSpec]:
    """``policy`` or ``policy+order[:k=v...]`` as (policy, its dispatch spec); a bare policy
    runs without a queue (the simulator's default, ``immediate``), live and simulated."""
    from stack.bench.experiments import split_policy

    policy, order = split_policy(spec)
    return policy, SIM_DISPATCH if order is None else DispatchSpec.parse(order)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated router policies to compare; policy+order[:k=v...] runs the router's dispatch "
        "queue with that order (as `smetric bench --policies`), a bare name runs without a queue "
        "(immediate), live and simulated alike (default: the product, smetric-global with the router's "
        "default dispatch, against LMetric as its authors ship it)",
    )
    p.add_argument("--trace", default=str(default_trace()), help="agentic or Mooncake JSONL trace")
    p.add_argument("--prefill", type=int, default=8, help="emulated prefill workers")
    p.add_argument("--decode", type=int, default=2, help="emulated decode workers")
    p.add_argument(
        "--workers-per-process",
        type=int,
        default=4,
        help="emulated workers sharing one process (each its own endpoint, KV events, Mooncake clients)",
    )
    p.add_argument(
        "--time-factor",
        type=float,
        default=0.3,
        help="emulator wall seconds per modelled second (below ~0.3 the host work of the live path "
        "stretches the figures on 2 shared cores: docs/fidelity.md)",
    )
    p.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="session starts per modelled second (default: the knee, chosen by the simulator)",
    )
    p.add_argument(
        "--knee-share",
        type=float,
        default=0.9,
        help="the knee: highest rate where the best baseline keeps this share of its light-load attainment",
    )
    add_window_arguments(p)
    p.add_argument("--repeat", type=int, default=1, help="live runs per policy (run-to-run spread)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="wall seconds per request, also the PD twins' bootstrap wait (default: 3000 modelled "
        "seconds, so that only a stuck request times out: the simulator has no timeouts)",
    )
    p.add_argument(
        "--config", default=None, help="deployment YAML for `smetric up` (default configs/local.yaml)"
    )
    p.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    p.add_argument("--no-sim", action="store_true", help="live figures only (no simulator beside them)")
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)  # the default now; kept
    p.add_argument("--out", default=None, help="write all results as one JSON file here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def live_one(args, spec: str, trace, show: bool, label: str) -> dict:
    from stack.replay.localstack import local_stack
    from stack.replay.progress import replay_with_progress

    policy, dispatch = dispatch_of(spec)
    with local_stack(
        config=stack_config(args, dispatch.to_config()),
        prefill=args.prefill,
        decode=args.decode,
        policy=policy,
        ports="auto",
        time_factor=args.time_factor,
        mooncake=not args.no_mooncake,
        workers_per_process=args.workers_per_process,
    ) as info:
        cfg, emu = pool_replay_config(args, info, info["router_url"], request_timeout(args))
        res = replay_with_progress(cfg, trace, label, show)
        res["policy"] = policy
        res["dispatch"] = dispatch.label()
        res["capacity_tokens"] = emu.get("capacity_tokens")
        res["hardware"] = emu.get("hardware")
        res["model_clock"] = clock_stats(info["prefill"] + info["decode"])
        return res


def request_timeout(args) -> float:
    return float(args.request_timeout or max(30.0, 3000.0 * args.time_factor))


def stack_config(args, dispatch: dict | None = None) -> str:
    """The deployment YAML for `smetric up`: ``--config`` (or configs/local.yaml) with the PD
    twins' bootstrap wait raised to the request timeout (its 30 s would abort the prefill of a
    500k-token prompt queued at the knee: an error the simulator cannot have)."""
    import tempfile

    import yaml

    from stack.launch.cli import default_config

    src = Path(args.config) if args.config else default_config()
    cfg = yaml.safe_load(src.read_text()) or {}
    launch = cfg.setdefault("launch", {})
    emu = launch.setdefault("emulator", {})
    emu["bootstrap_timeout_s"] = max(float(emu.get("bootstrap_timeout_s") or 0), request_timeout(args))
    if dispatch is not None:  # the run's dispatch queue, as the simulator beside it runs it
        cfg.setdefault("router", {})["dispatch"] = dispatch
    fd, path = tempfile.mkstemp(prefix="demo-live-", suffix=".yaml")
    with open(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return path


def clock_stats(urls: list[str]) -> dict:
    """The workers' modelled clocks, summed: late steps, resyncs (wall time given up), max lag."""
    import httpx

    out = {"steps": 0, "late_steps": 0, "resyncs": 0, "lost_wall_s": 0.0, "max_lag_s": 0.0}
    for u in urls:
        try:
            st = httpx.get(u + "/server_info", timeout=10).json()["internal_states"][0]["model_clock"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            continue
        for k in ("steps", "late_steps", "resyncs", "lost_wall_s"):
            out[k] += st.get(k, 0)
        out["max_lag_s"] = max(out["max_lag_s"], st.get("max_lag_s", 0.0))
    return out


def sim_one(args, spec: str, trace, hardware: str = HARDWARE, hbm: int | None = HBM) -> dict:
    policy, dispatch = dispatch_of(spec)
    return simulate_pool(
        args, trace, policy, hardware, hbm, dispatch=dispatch.order, dispatch_params=dispatch.settings()
    )


def choose_knee(args, policies: list[str], trace) -> fidelity.Knee:
    """The knee of the local cluster, by the simulator: baselines are the policies compared
    other than the SMetric family (all of them when that leaves none)."""
    from stack.policies import is_smetric

    baselines = [p for p in policies if not is_smetric(dispatch_of(p)[0])] or policies

    def att(policy: str, rate: float) -> float:
        a = argparse.Namespace(**{**vars(args), "session_rate": rate})
        v = sim_one(a, policy, trace).get("slo_attainment")
        return float(v) if v is not None else 0.0

    return fidelity.knee_rate(att, baselines, KNEE_RATES, args.knee_share)


def _pm(s: dict, f: str) -> str:
    """live mean (+-spread%) over the repeats."""
    m = fmt_cell(s["live_mean"], f)
    if s["live_spread"] is None or s.get("runs", 2) < 2:
        return m
    return f"{m} ±{s['live_spread']:.0%}"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from stack.policies import POLICIES
    from stack.traces.load import load_trace

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for pol in policies:
        name, dispatch = dispatch_of(pol)  # ValueError on an unknown order or parameter
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        dispatch.to_config()  # ValueError where the router cannot run it (replicas)
    if args.repeat < 1:
        raise ValueError(f"--repeat: must be >= 1 (got {args.repeat})")
    if args.prefill < 1 or args.decode < 1 or args.workers_per_process < 1:
        raise ValueError("--prefill, --decode and --workers-per-process must be >= 1")
    trace = load_trace(args.trace)
    show = not args.no_progress and sys.stderr.isatty()
    console = Console() if sys.stdout.isatty() else Console(width=220)
    knee = None
    if args.session_rate is None:
        knee = choose_knee(args, policies, trace)
        args.session_rate = knee.rate
        console.print(
            f"knee (simulator, {args.prefill} instances): {knee.rate} sessions/s, where {knee.baseline} "
            f"attains {knee.attainment:.1%} (target {knee.target:.1%} = {args.knee_share:.0%} of its "
            f"light-load {knee.ceiling:.1%})"
        )
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for i in range(args.repeat):
        for pol in policies:
            label = f"live {pol}" + (f" {i + 1}/{args.repeat}" if args.repeat > 1 else "")
            runs[pol].append(live_one(args, pol, trace, show, label))
    sims: dict[str, dict] | None = None
    if not args.no_sim:
        sims = {}
        for pol in policies:
            first = runs[pol][0]
            sims[pol] = sim_one(
                args, pol, trace, first.get("hardware") or HARDWARE, first.get("capacity_tokens")
            )
    summary = {p: fidelity.summarize_runs(runs[p], sims[p] if sims else None) for p in policies}
    t = Table(
        title=f"demo-live: {Path(args.trace).name}, {args.prefill} prefill + {args.decode} decode emulated "
        f"workers, {args.session_rate} sessions/s for {args.duration:.0f} s (modelled), "
        f"{args.repeat} run(s) per policy"
    )
    t.add_column("figure", no_wrap=True)
    for pol in policies:
        t.add_column(f"{pol}\nlive", justify="right")
        if sims:
            t.add_column(f"{pol}\nsim", justify="right")
            t.add_column(f"{pol}\nlive/sim", justify="right")
    for key, head, f in ROWS:
        row = [head]
        for pol in policies:
            s = {**summary[pol][key], "runs": summary[pol]["runs"]}
            row.append(_pm(s, f))
            if sims:
                row += [fmt_cell(s["sim"], f), fmt_cell(s["gap"], "{:+.0%}")]
        t.add_row(*row)
    row = ["requests measured"]
    for pol in policies:
        row.append(" / ".join(str(r.get("requests")) for r in runs[pol]))
        if sims:
            row += [str(sims[pol].get("requests")), ""]
    t.add_row(*row)
    row = ["errors"]
    for pol in policies:
        row.append(str(summary[pol]["errors"]))
        if sims:
            row += ["", ""]
    t.add_row(*row)
    console.print(t)
    console.print(
        "TTFTs and TPS in modelled seconds (wall / time factor); prefill TPS within SLO: prompt tokens of "
        "requests that met the TTFT SLO per second of the measurement window; live: mean ±half the "
        "range over the repeats."
    )
    behind = {p: sum(r["model_clock"]["resyncs"] for r in runs[p]) for p in policies}
    if any(behind.values()):
        console.print(
            "[yellow]the emulator fell behind its modelled clock "
            + ", ".join(f"{p}: {n} times" for p, n in behind.items())
            + ": host CPU is short for this time factor; figures are stretched (raise --time-factor)[/]"
        )
    console.print(fidelity.verdict(runs, sims))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "settings": {
                k: (repo_relative(v) if k in ("trace", "out") and v else v)
                for k, v in vars(args).items()
                if k not in ("func",)
            },
            "knee": vars(knee) if knee else None,
            "summary": summary,
            "verdict": fidelity.verdict(runs, sims),
            "runs": runs,
            "sim": sims,
        }
        out.write_bytes(
            orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_DATACLASS, default=str)
            + b"\n"
        )
        console.print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:  # `python -m stack.commands.demo_live`
    p = argparse.ArgumentParser(
        prog="smetric demo-live", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
