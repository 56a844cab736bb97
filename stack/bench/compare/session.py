"""The whole of ``smetric compare``: check the configurations, take stored runs
(``--resim``: instead of live runs; ``--append``: beside new ones), run the live rounds
(the order reversed on every other round), simulate each configuration, write compare.json,
compare.csv and compare.png and print the table."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import orjson

from stack.bench.compare.aggregate import aggregate, ordering
from stack.bench.compare.live import live_run
from stack.bench.compare.peer_router import PEER_POLICIES, sglang_router_version
from stack.bench.compare.report import plot, print_table, write_csv
from stack.bench.compare.simulated import sim_counterpart, sim_run
from stack.bench.live import fmt_cell

Config = tuple[str, str]  # (router: "smetric" or "sglang-router", policy)

#: the settings every stored run of one output directory must share (--append checks them)
RUN_SETTINGS = (
    "prefill",
    "decode",
    "time_factor",
    "session_rate",
    "duration",
    "warmup",
    "max_think",
    "seed",
)


def config_key(c: Config) -> str:
    """A configuration's key in compare.json: ``ours:POLICY`` or ``sglang-router:POLICY``."""
    return f"{'ours' if c[0] == 'smetric' else 'sglang-router'}:{c[1]}"


def compare(args: argparse.Namespace, ours: list[str], peers: list[str]) -> int:
    """Our router with each of ``ours``, sglang-router with each of ``peers``: live runs,
    simulations, the files and the table (``args``: ``smetric compare``'s options)."""
    from stack.traces.load import load_trace

    check(args, ours, peers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(args.trace)
    show = not args.no_progress and sys.stderr.isatty()
    configs: list[Config] = [("smetric", p) for p in ours] + [("sglang-router", p) for p in peers]

    def _term(signum, frame):  # SIGTERM: stop the pools and routers started so far, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    runs: dict[Config, list[dict]] = {c: [] for c in configs}
    if args.resim:
        configs = take_stored_for_resim(args, out, configs, runs)
        trace = load_trace(args.trace)
    first = 0
    requested = list(configs)
    if args.append and not args.resim and (out / "compare.json").exists():
        configs, first = take_stored_for_append(args, out, configs, runs)
    if not args.resim:
        live_rounds(args, requested, runs, range(first, first + args.repeat), trace, show, out)
    rows, sims = simulate(args, configs, runs, trace)
    write_results(args, out, rows, runs, sims)
    return 0


def check(args: argparse.Namespace, ours: list[str], peers: list[str]) -> None:
    """ValueError on an unknown policy, nothing to compare, or what the runs need missing."""
    from stack.policies import POLICIES

    for pol in ours:
        if pol not in POLICIES:
            raise ValueError(f"unknown policy {pol!r} (known: {', '.join(POLICIES)})")
    for pol in peers:
        if pol not in PEER_POLICIES:
            raise ValueError(f"unknown sglang-router policy {pol!r} (known: {', '.join(PEER_POLICIES)})")
    if not ours and not peers:
        raise ValueError("nothing to compare: --policies and --peer-policies are both empty")
    if peers and not args.resim:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            raise ValueError("sglang-router is not installed (pip install sglang-router)") from None
    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    if args.time_factor <= 0:
        raise ValueError("--time-factor must be > 0")
    if not args.no_mooncake and not args.resim and shutil.which("mooncake_master") is None:
        raise ValueError("mooncake_master not found (scripts/setup.sh installs it; or pass --no-mooncake)")


def take_stored_for_resim(
    args: argparse.Namespace, out: Path, configs: list[Config], runs: dict[Config, list[dict]]
) -> list[Config]:
    """``--resim``: the stored live runs of ``configs`` into ``runs`` (compare.json, whose
    settings then replace ``args``', else compare.partial.json); the configurations that have any."""
    src = out / "compare.json"
    if src.exists():
        old = orjson.loads(src.read_bytes())
        stored, settings = old["runs"], old.get("settings") or {}
        for k in ("prefill", "decode", "time_factor", "session_rate", "duration", "warmup", "max_think"):
            if k in settings:
                setattr(args, k, settings[k])
        for k in ("seed", "repeat", "no_mooncake", "trace", "request_timeout"):
            if k in settings:
                setattr(args, k, settings[k])
    else:
        stored = orjson.loads((out / "compare.partial.json").read_bytes())
    for c in configs:
        runs[c] = list(stored.get(config_key(c)) or stored.get(f"{c[0]}:{c[1]}") or [])
    configs = [c for c in configs if runs[c]]
    if not configs:
        raise ValueError(f"no stored runs of these configurations under {out}")
    return configs


def take_stored_for_append(
    args: argparse.Namespace, out: Path, configs: list[Config], runs: dict[Config, list[dict]]
) -> tuple[list[Config], int]:
    """``--append``: every stored run of compare.json into ``runs`` (its settings must be
    ``args``'); the configurations (stored first) and the first new round's number."""
    old = orjson.loads((out / "compare.json").read_bytes())
    for k in RUN_SETTINGS:
        if (old.get("settings") or {}).get(k) not in (None, getattr(args, k)):
            raise ValueError(f"--append: {k} differs from the stored runs' ({old['settings'][k]})")
    stored = []
    for key, v in old["runs"].items():
        who, pol = key.split(":", 1)
        c = ("smetric" if who == "ours" else "sglang-router", pol)
        stored.append(c)
        runs[c] = list(v)
    configs = stored + [c for c in configs if c not in stored]
    first = max((r.get("repeat", 0) + 1 for v in runs.values() for r in v), default=0)
    return configs, first


def live_rounds(
    args: argparse.Namespace,
    requested: list[Config],
    runs: dict[Config, list[dict]],
    rounds: range,
    trace,
    show: bool,
    out: Path,
) -> None:
    """Every round runs each requested configuration once (odd rounds in reverse order),
    saving compare.partial.json after each run and saying how it went on stderr."""
    for rep in rounds:
        order = requested if rep % 2 == 0 else list(reversed(requested))
        for router, pol in order:
            with contextlib.redirect_stdout(sys.stderr):  # `smetric up`'s JSON line
                res = live_run(args, router, pol, trace, show, out / "logs")
            res["repeat"] = rep
            runs[(router, pol)].append(res)
            partial = {f"{r}:{p}": v for (r, p), v in runs.items() if v}
            (out / "compare.partial.json").write_bytes(orjson.dumps(partial, option=orjson.OPT_INDENT_2))
            print(
                f"[{time.strftime('%H:%M:%S')}] {router} {pol} (round {rep + 1}): "
                f"{res['requests']} requests, TPS within SLO {res['prefill_tps_within_slo']:.0f}, "
                f"TTFT p50 {fmt_cell(res.get('ttft_p50'), '{:.2f}')} s, errors {res['errors']} {res.get('error_kinds') or ''}, "
                f"lost {res['lost']}, "
                f"load {res['loadavg_before'][0]:.1f}->{res['loadavg_after'][0]:.1f}",
                file=sys.stderr,
                flush=True,
            )


def simulate(
    args: argparse.Namespace, configs: list[Config], runs: dict[Config, list[dict]], trace
) -> tuple[list[dict], dict[Config, dict | None]]:
    """Per configuration its simulated counterpart (none with ``--no-sim``, or without one)
    and its row (aggregate.py)."""
    sims: dict[Config, dict | None] = {}
    rows = []
    for c in configs:
        sp, params, note = sim_counterpart(*c)
        sim = None
        if sp is not None and not args.no_sim:
            r0 = runs[c][0]
            sim = sim_run(args, sp, params, trace, r0.get("hardware") or "h20", r0.get("capacity_tokens"))
            sim["policy_params"] = params
        sims[c] = sim
        rows.append(aggregate(runs[c], sim, sp, note))
    return rows, sims


def write_results(
    args: argparse.Namespace,
    out: Path,
    rows: list[dict],
    runs: dict[Config, list[dict]],
    sims: dict[Config, dict | None],
) -> None:
    """compare.json, compare.csv, compare.png, the table."""
    order = None if args.no_sim else ordering(rows)
    title = (
        f"{Path(args.trace).name}: {args.prefill} prefill + {args.decode} decode emulated workers, "
        f"{args.session_rate} sessions/s for {args.duration:.0f} s (modelled), time factor {args.time_factor}, "
        f"{max(len(v) for v in runs.values())} run(s) each"
    )
    result = {
        "settings": {
            k: getattr(args, k) for k in ("trace", *RUN_SETTINGS, "request_timeout", "repeat", "no_mooncake")
        },
        "sglang_router_version": sglang_router_version(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "ordering": order,
        "runs": {config_key(c): v for c, v in runs.items()},
        "sim": {config_key(c): v for c, v in sims.items()},
    }
    (out / "compare.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    write_csv(rows, out / "compare.csv")
    plot(rows, out / "compare.png", title)
    print_table(rows, title, order)
    print(f"wrote {out / 'compare.json'}, {out / 'compare.csv'}, {out / 'compare.png'}")
