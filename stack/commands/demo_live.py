"""`smetric demo-live`: the main job over the real HTTP path.

Brings up the local PD stack (``smetric up``: mooncake_master, emulated prefill and decode
workers, the router) once per policy, replays a slice of the shipped agentic trace through
the router with ``smetric replay``'s load model, and prints prefill TPS within SLO and TTFT
side by side; with ``--sim`` the simulator's figures for the same trace, load, instance
count and calibration sit beside them. Everything started is stopped again (also on
Ctrl-C). About 2-3 minutes on 2 cores with the defaults.

Times are modelled seconds (wall seconds / the emulator's time factor).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from stack.commands.simopts import session_load
from stack.paths import default_trace

COLUMNS = [
    ("prefill_tps_within_slo", "prefill TPS\nwithin SLO", "{:,.0f}"),
    ("slo_attainment", "SLO\nattainment", "{:.0%}"),
    ("ttft_p50", "TTFT p50\n(s)", "{:.2f}"),
    ("ttft_p90", "TTFT p90\n(s)", "{:.2f}"),
    ("reuse_total", "reuse", "{:.0%}"),
    ("requests", "requests", "{}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--policies", default="smetric,lmetric", help="comma-separated router policies to compare")
    p.add_argument("--trace", default=str(default_trace()), help="agentic or Mooncake JSONL trace")
    p.add_argument("--prefill", type=int, default=2, help="emulated prefill workers")
    p.add_argument("--decode", type=int, default=1, help="emulated decode workers")
    p.add_argument("--time-factor", type=float, default=0.1, help="emulator wall seconds per modelled second")
    p.add_argument("--session-rate", type=float, default=0.03, help="session starts per modelled second")
    p.add_argument("--duration", type=float, default=600.0, help="modelled seconds of session arrivals")
    p.add_argument("--warmup", type=float, default=100.0, help="modelled seconds excluded from the metrics")
    p.add_argument("--max-think", type=float, default=30.0, help="cap on think times (modelled s)")
    p.add_argument("--seed", type=int, default=3, help="seed of the session arrivals")
    p.add_argument("--request-timeout", type=float, default=30.0, help="wall seconds per request")
    p.add_argument(
        "--config", default=None, help="deployment YAML for `smetric up` (default configs/local.yaml)"
    )
    p.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    p.add_argument(
        "--sim", action="store_true", help="also simulate each policy on the same load (side by side)"
    )
    p.add_argument("--out", default=None, help="write all results as one JSON file here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def live_one(args, policy: str, trace, show: bool) -> dict:
    import httpx

    from stack.commands.replay import replay_with_progress
    from stack.replay.driver import ReplayConfig
    from stack.replay.localstack import local_stack

    with local_stack(
        config=args.config,
        prefill=args.prefill,
        decode=args.decode,
        policy=policy,
        ports="auto",
        time_factor=args.time_factor,
        mooncake=not args.no_mooncake,
    ) as info:
        si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
        tf = float((si.get("emulator") or {}).get("time_factor") or args.time_factor)
        tok = si.get("tokenizer_path")
        cfg = ReplayConfig(
            target=info["router_url"],
            trace=args.trace,
            load=session_load(args),
            time_factor=tf,
            request_timeout=args.request_timeout,
            tokenizer=tok if tok and Path(tok).is_dir() else None,
        )
        res = replay_with_progress(cfg, trace, f"live {policy}", show)
        res["policy"] = policy
        res["capacity_tokens"] = (si.get("emulator") or {}).get("capacity_tokens")
        res["hardware"] = (si.get("emulator") or {}).get("hardware")
        return res


def sim_one(args, policy: str, trace, hardware: str = "h20", hbm: int | None = 200_000) -> dict:
    from stack.prefill_router.cost_model import load_hardware
    from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator

    cfg = SimConfig(
        instances=args.prefill,
        hardware=load_hardware(hardware),
        global_tier=GlobalTierSpec("none" if args.no_mooncake else "full"),
        hbm_tokens=hbm,
    )
    return Simulator(trace, policy, cfg, session_load(args)).run().metrics


def fmt_cell(v, f: str) -> str:
    if v is None:
        return "-"
    try:
        return f.format(v)
    except (ValueError, TypeError):
        return str(v)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from stack.traces.load import load_trace

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    from stack.prefill_router.policies import POLICIES

    for pol in policies:
        if pol not in POLICIES:
            raise ValueError(f"unknown policy {pol!r} (known: {', '.join(POLICIES)})")
    trace = load_trace(args.trace)
    show = not args.no_progress and sys.stderr.isatty()
    console = Console() if sys.stdout.isatty() else Console(width=220)
    results: dict[str, dict] = {}
    for pol in policies:
        live = live_one(args, pol, trace, show)
        results[pol] = {"live": live}
        if args.sim:
            results[pol]["sim"] = sim_one(
                args, pol, trace, live.get("hardware") or "h20", live.get("capacity_tokens")
            )
    t = Table(
        title=f"live replay: {Path(args.trace).name}, {args.prefill} prefill + {args.decode} decode emulated "
        f"workers, {args.session_rate} sessions/s for {args.duration:.0f} s (modelled)"
    )
    t.add_column("policy", no_wrap=True)
    for _key, head, _ in COLUMNS:
        t.add_column(head, justify="right")
    if args.sim:
        t.add_column("sim: prefill TPS\nwithin SLO", justify="right")
        t.add_column("sim: TTFT\np50 (s)", justify="right")
    t.add_column("errors", justify="right")
    for pol in policies:
        live = results[pol]["live"]
        row = [pol] + [fmt_cell(live.get(k), f) for k, _, f in COLUMNS]
        if args.sim:
            sim = results[pol]["sim"]
            row += [
                fmt_cell(sim.get("prefill_tps_within_slo"), "{:,.0f}"),
                fmt_cell(sim.get("ttft_p50"), "{:.2f}"),
            ]
        row.append(str(live.get("errors", 0)))
        t.add_row(*row)
    console.print(t)
    console.print(
        "TTFTs and TPS in modelled seconds (wall / time factor); prefill TPS within SLO: prompt tokens of "
        "requests that met the TTFT SLO per second of the measurement window."
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
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
