"""`smetric compare`: our router's policies next to the real sglang-router, live and simulated.

For every router configuration -- our router with each of ``--policies``, and sglang-router
(PyPI ``sglang-router``, PD mode) with each of ``--peer-policies`` -- a fresh emulated PD pool
is started (``smetric up``: mooncake_master, emulated prefill and decode workers; caches start
cold), then the router in front of it, and the same slice is replayed over HTTP with
``smetric replay``'s load model (seeded Poisson session starts, closed-loop follow-ups).
``smetric sim`` runs the same trace, load, instance count and calibration for each
configuration: our policies as themselves, sglang-router's through their closest counterpart
in the simulator (``SIM_COUNTERPARTS``; an approximation, printed with the results).

sglang-router is launched as its docs show for PD mode::

    python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill URL BOOTSTRAP_PORT ... --decode URL --prefill-policy P --decode-policy round_robin

it sends each request to a prefill and a decode worker at once with bootstrap_host /
bootstrap_port / bootstrap_room added, as our router does, and streams decode's answer.

Writes DIR/compare.json (every run, every metric), DIR/compare.csv (one row per
configuration), DIR/compare.png (prefill TPS within SLO and TTFT, live next to sim) and
prints a table. With ``--repeat N`` every live configuration runs N times (the order
reversed on every other round) and the spread between runs is reported: differences within
it are noise. Times are modelled seconds (wall seconds / the emulator's time factor).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from stack.commands.demo_live import fmt_cell
from stack.commands.simopts import session_load
from stack.paths import default_trace
from stack.ports import free_port

PEER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")

# sglang-router policy -> (simulator policy: a name of ours or of a stand-in such as
# "sglang-cache-aware~" (stack/policies/sglang_cache_aware.py), its parameters,
# how close it is)
SIM_COUNTERPARTS: dict[str, tuple[str, dict, str]] = {
    "round_robin": ("round-robin", {}, "same rule"),
    "cache_aware": (
        "random",
        {},
        "what 0.3.2 does in PD mode: it logs 'No tree found for model ..., using random worker "
        "selection' for every prefill and decode choice (docs/results.md); the approximate-tree "
        "stand-in sglang-cache-aware~ models the policy as designed",
    ),
    "random": ("random", {}, "same rule"),
    "power_of_two": (
        "linear",
        {"lam": 0.0},
        "approximation: with 2 prefill workers both are sampled, so it is join-the-shortest-queue on "
        "in-flight requests (linear with lam=0)",
    ),
}


#: the settings every stored run of one output directory must share (--append checks them)
_RUN_SETTINGS = (
    "prefill",
    "decode",
    "time_factor",
    "session_rate",
    "duration",
    "warmup",
    "max_think",
    "seed",
)

METRICS = (
    "prefill_tps_within_slo",
    "slo_attainment",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "reuse_total",
    "reuse_local",
    "reuse_global",
    "prefill_tps",
    "imbalance_mean",
)
LIVE_COUNTS = ("requests", "requests_total", "requests_sent", "errors", "errors_measured", "lost", "wall_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--trace", default=str(default_trace()), help="agentic or Mooncake JSONL trace")
    p.add_argument(
        "--policies",
        default="smetric,smetric-global,lmetric,least-load,dynamo,round-robin",
        help="our router's policies (comma-separated; '' for none)",
    )
    p.add_argument(
        "--peer-policies",
        default="cache_aware,round_robin,power_of_two",
        help=f"sglang-router policies (comma-separated; '' for none; known: {', '.join(PEER_POLICIES)})",
    )
    p.add_argument("--prefill", type=int, default=2, help="emulated prefill workers")
    p.add_argument("--decode", type=int, default=1, help="emulated decode workers")
    p.add_argument("--time-factor", type=float, default=0.1, help="emulator wall seconds per modelled second")
    p.add_argument(
        "--rate",
        "--session-rate",
        dest="session_rate",
        type=float,
        default=0.03,
        help="session starts per modelled second",
    )
    p.add_argument("--duration", type=float, default=600.0, help="modelled seconds of session arrivals")
    p.add_argument("--warmup", type=float, default=100.0, help="modelled seconds excluded from the metrics")
    p.add_argument("--max-think", type=float, default=30.0, help="cap on think times (modelled s)")
    p.add_argument("--seed", type=int, default=3, help="seed of the session arrivals")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="wall seconds per request (and for draining after the last arrival)",
    )
    p.add_argument("--repeat", type=int, default=1, help="live runs per configuration (spread = noise)")
    p.add_argument("--config", default=None, help="deployment YAML for the pool (default configs/local.yaml)")
    p.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    p.add_argument("--no-sim", action="store_true", help="live runs only")
    p.add_argument("--out", default="out/compare", help="output directory")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the live runs already in OUT/compare.json (same settings) and add --repeat more",
    )
    p.add_argument(
        "--resim",
        action="store_true",
        help="no live runs: take them from OUT/compare.json (or compare.partial.json), simulate again, "
        "rewrite the outputs (e.g. after a sim counterpart changed)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _split(s: str) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def sglang_router_cmd(
    prefill: list[tuple[str, int | None]],
    decode: list[str],
    policy: str,
    port: int,
    prom_port: int,
    request_timeout: float,
) -> list[str]:
    """The command line of sglang-router in PD mode (its documented flags, 0.3.x)."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, boot in prefill:
        cmd += ["--prefill", url, str(boot) if boot is not None else "none"]
    for url in decode:
        cmd += ["--decode", url]
    # the policy under test routes prefill; decode (one worker in the default pool) round-robin:
    # `--policy power_of_two` would also apply to a single decode worker
    cmd += ["--prefill-policy", policy, "--decode-policy", "round_robin"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]
    cmd += ["--request-timeout-secs", str(max(1, int(math.ceil(request_timeout))))]
    cmd += ["--log-level", "warn"]
    return cmd


def _wait_sglang_router(url: str, proc: subprocess.Popen, n_workers: int, timeout: float = 60.0) -> None:
    """Until /health answers and every worker is registered (/workers), or fail."""
    import httpx

    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang-router exited with {proc.returncode}")
        try:
            h = httpx.get(url + "/health", timeout=2.0)
            w = httpx.get(url + "/workers", timeout=2.0)
            if h.status_code == 200 and w.status_code == 200:
                data = w.json()
                workers = data.get("workers", data) if isinstance(data, dict) else data
                n = len(workers) if isinstance(workers, list) else 0
                if n >= n_workers:
                    return
                last = f"{n} of {n_workers} workers registered"
            else:
                last = f"/health {h.status_code}, /workers {w.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(f"sglang-router not ready after {timeout:.0f} s ({last})")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def live_run(args, router: str, policy: str, trace, show: bool, log_dir: Path) -> dict:
    """One live run: a fresh pool, the router (ours or sglang-router), one replay."""
    import httpx
    import yaml

    from stack.commands.replay import replay_with_progress
    from stack.replay.driver import ReplayConfig
    from stack.replay.localstack import local_stack

    ours = router == "smetric"
    load0 = os.getloadavg()
    t_start = time.time()
    with local_stack(
        config=args.config,
        prefill=args.prefill,
        decode=args.decode,
        policy=policy if ours else None,
        ports="auto",
        time_factor=args.time_factor,
        mooncake=not args.no_mooncake,
        router=ours,
    ) as info:
        si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
        emu = si.get("emulator") or {}
        tf = float(emu.get("time_factor") or args.time_factor)
        tok = si.get("tokenizer_path")
        proc = None
        try:
            if ours:
                target, metrics_url = info["router_url"], None
            else:
                rcfg = yaml.safe_load((Path(info["run_dir"]) / "router-config.yaml").read_text())
                prefill = [(w["url"], w.get("bootstrap_port")) for w in rcfg["prefill"]]
                decode = [w["url"] for w in rcfg["decode"]]
                port = free_port()
                cmd = sglang_router_cmd(prefill, decode, policy, port, free_port(), args.request_timeout)
                log_dir.mkdir(parents=True, exist_ok=True)
                log = open(log_dir / f"sglang-router-{policy}.log", "ab")  # noqa: SIM115
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=dict(os.environ, HF_HUB_OFFLINE="1", RUST_LOG_STYLE="never", NO_COLOR="1"),
                )
                log.close()
                target, metrics_url = f"http://127.0.0.1:{port}", ""
                _wait_sglang_router(target, proc, len(prefill) + len(decode))
            cfg = ReplayConfig(
                target=target,
                trace=args.trace,
                load=session_load(args),
                time_factor=tf,
                request_timeout=args.request_timeout,
                tokenizer=tok if tok and Path(tok).is_dir() else None,
                metrics_url=metrics_url,
            )
            label = f"{'ours' if ours else 'sglang-router'} {policy}"
            res = replay_with_progress(cfg, trace, label, show)
            res["prefill_workers"] = _worker_counters(info["prefill"])
        finally:
            if proc is not None:
                _stop(proc)
    res["router"] = "smetric router" if ours else "sglang-router"
    res["policy"] = policy
    res["capacity_tokens"] = emu.get("capacity_tokens")
    res["hardware"] = emu.get("hardware")
    res["lost"] = int(res.get("requests_sent") or 0) - int(res.get("requests_total") or 0)
    res["loadavg_before"] = [round(x, 2) for x in load0]
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start))
    return res


def _worker_counters(urls: list[str]) -> list[dict]:
    """Per prefill worker: requests, prompt and cached tokens it counted (its /metrics)."""
    import httpx

    from stack.replay.metrics import parse_prometheus

    want = {
        "sglang:num_requests_total": "requests",
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "cached_tokens",
        "smetric_worker_cached_tokens_local_total": "cached_local",
    }
    out = []
    for u in urls:
        row: dict = {"url": u}
        try:
            for name, _labels, value in parse_prometheus(httpx.get(u + "/metrics", timeout=5).text):
                if name in want:
                    row[want[name]] = row.get(want[name], 0) + value
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e)[:200]
        out.append(row)
    return out


def sim_run(args, policy: str, params: dict, trace, hardware: str, hbm: int | None) -> dict:
    from stack.core.cost_model import load_hardware
    from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator

    cfg = SimConfig(
        instances=args.prefill,
        hardware=load_hardware(hardware or "h20"),
        global_tier=GlobalTierSpec("none" if args.no_mooncake else "full"),
        hbm_tokens=hbm,
        policy_params=dict(params),
    )
    # a policy of ours, or a stand-in for sglang-router's (policies.STAND_INS), by name
    return Simulator(trace, policy, cfg, session_load(args)).run().metrics


def _num(v) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _mean(xs: list) -> float | None:
    xs = [x for x in (_num(x) for x in xs) if x is not None]
    return sum(xs) / len(xs) if xs else None


def _spread(xs: list) -> float | None:
    xs = [x for x in (_num(x) for x in xs) if x is not None]
    return (max(xs) - min(xs)) if len(xs) >= 2 else None


def aggregate(runs: list[dict], sim: dict | None, counterpart: str | None, note: str) -> dict:
    r0 = runs[0]
    row: dict = {
        "config": f"{'ours' if r0['router'] == 'smetric router' else 'sglang-router'}:{r0['policy']}",
        "router": r0["router"],
        "policy": r0["policy"],
        "sim_policy": counterpart,
        "sim_note": note,
        "runs": len(runs),
    }
    for k in METRICS:
        row[f"live_{k}"] = _mean([r.get(k) for r in runs])
        if len(runs) > 1:
            row[f"live_{k}_spread"] = _spread([r.get(k) for r in runs])
        row[f"sim_{k}"] = _num(sim.get(k)) if sim else None
    for k in LIVE_COUNTS:
        row[f"live_{k}"] = _mean([r.get(k) for r in runs])
    row["live_errors_max"] = max(int(r.get("errors") or 0) for r in runs)
    row["live_lost_max"] = max(int(r.get("lost") or 0) for r in runs)
    row["sim_requests"] = sim.get("requests") if sim else None
    lt, st = row["live_prefill_tps_within_slo"], row["sim_prefill_tps_within_slo"]
    row["gap_tps_within_slo"] = (lt - st) / st if lt is not None and st else None
    lp, sp = row["live_ttft_p50"], row["sim_ttft_p50"]
    row["gap_ttft_p50"] = (lp - sp) / sp if lp is not None and sp else None
    row["loadavg_1m_max"] = max(max(r["loadavg_before"][0], r["loadavg_after"][0]) for r in runs)
    return row


def ordering(rows: list[dict], key: str = "prefill_tps_within_slo") -> dict:
    """Does the simulator order the configurations as the live runs do (higher is better)?

    Pairwise: a pair is concordant when live and sim agree on which is better; a discordant
    pair whose live difference is within the live run-to-run spread (the larger spread of the
    two, or 5% when there is one run) is noise, not a wrong prediction."""
    rs = [r for r in rows if r.get(f"live_{key}") is not None and r.get(f"sim_{key}") is not None]
    live = sorted(rs, key=lambda r: -r[f"live_{key}"])
    sim = sorted(rs, key=lambda r: -r[f"sim_{key}"])
    pairs = []
    conc = disc = 0
    for i in range(len(rs)):
        for j in range(i + 1, len(rs)):
            a, b = rs[i], rs[j]
            dl = a[f"live_{key}"] - b[f"live_{key}"]
            ds = a[f"sim_{key}"] - b[f"sim_{key}"]
            if dl * ds > 0 or (dl == 0 and ds == 0):
                conc += 1
                continue
            sp = [x for x in (a.get(f"live_{key}_spread"), b.get(f"live_{key}_spread")) if x is not None]
            noise = max(sp) if sp else 0.05 * max(abs(a[f"live_{key}"]), abs(b[f"live_{key}"]))
            within = abs(dl) <= noise
            if not within:
                disc += 1
            pairs.append(
                {
                    "a": a["config"],
                    "b": b["config"],
                    "live_diff": dl,
                    "sim_diff": ds,
                    "noise": noise,
                    "noise_basis": "run-to-run spread" if sp else "5% (single run)",
                    "within_noise": within,
                }
            )
    n = len(rs) * (len(rs) - 1) // 2
    return {
        "metric": key,
        "live_order": [r["config"] for r in live],
        "sim_order": [r["config"] for r in sim],
        "pairs": n,
        "concordant": conc,
        "discordant_beyond_noise": disc,
        "discordant_within_noise": len(pairs) - disc,
        "agreement": (n - disc) / n if n else None,  # pairs ordered alike or within noise
        "discordant": pairs,
    }


CSV_KEYS = [
    "config",
    "router",
    "policy",
    "sim_policy",
    "runs",
    "live_prefill_tps_within_slo",
    "live_prefill_tps_within_slo_spread",
    "sim_prefill_tps_within_slo",
    "gap_tps_within_slo",
    "live_slo_attainment",
    "sim_slo_attainment",
    "live_ttft_p50",
    "sim_ttft_p50",
    "gap_ttft_p50",
    "live_ttft_p90",
    "sim_ttft_p90",
    "live_reuse_total",
    "sim_reuse_total",
    "live_reuse_local",
    "sim_reuse_local",
    "live_requests",
    "sim_requests",
    "live_requests_sent",
    "live_errors_max",
    "live_lost_max",
    "loadavg_1m_max",
]


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_KEYS})


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    x = list(range(len(rows)))
    w = 0.38
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(rows) + 4), 4.8))
    panels = (
        ("prefill_tps_within_slo", "prefill TPS within SLO (tokens/s)"),
        ("ttft_p50", "TTFT p50 (bars) / p90 (ticks), modelled s, log scale"),
    )
    for ax, (key, label) in zip(axes, panels, strict=True):
        live = [r.get(f"live_{key}") or 0.0 for r in rows]
        sim = [r.get(f"sim_{key}") or 0.0 for r in rows]
        err = [r.get(f"live_{key}_spread") or 0.0 for r in rows]
        colors = ["tab:blue" if r["router"] == "smetric router" else "tab:orange" for r in rows]
        ax.bar([i - w / 2 for i in x], live, w, color=colors, yerr=[e / 2 for e in err], label="live")
        ax.bar([i + w / 2 for i in x], sim, w, color="lightgray", edgecolor="gray", label="sim")
        if key == "ttft_p50":
            ax.scatter(
                [i - w / 2 for i in x],
                [r.get("live_ttft_p90") or 0 for r in rows],
                marker="_",
                s=200,
                color="black",
                label="live p90",
                zorder=3,
            )
            ax.scatter(
                [i + w / 2 for i in x],
                [r.get("sim_ttft_p90") or 0 for r in rows],
                marker="_",
                s=200,
                color="dimgray",
                label="sim p90",
                zorder=3,
            )
        if key == "ttft_p50":
            ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="tab:blue", label="live, smetric router"),
        Patch(color="tab:orange", label="live, sglang-router"),
        Patch(facecolor="lightgray", edgecolor="gray", label="sim (same load)"),
    ]
    axes[0].legend(handles=handles, fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], title: str, order: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=230)
    t = Table(title=title)
    cols = [
        ("config", "config", "{}"),
        ("sim_policy", "sim\ncounterpart", "{}"),
        ("live_prefill_tps_within_slo", "live: TPS\nwithin SLO", "{:,.0f}"),
        ("live_prefill_tps_within_slo_spread", "±spread", "{:,.0f}"),
        ("sim_prefill_tps_within_slo", "sim: TPS\nwithin SLO", "{:,.0f}"),
        ("gap_tps_within_slo", "gap\nlive/sim", "{:+.0%}"),
        ("live_slo_attainment", "live\nSLO att.", "{:.0%}"),
        ("sim_slo_attainment", "sim\nSLO att.", "{:.0%}"),
        ("live_ttft_p50", "live TTFT\np50 (s)", "{:.2f}"),
        ("sim_ttft_p50", "sim TTFT\np50 (s)", "{:.2f}"),
        ("live_ttft_p90", "live TTFT\np90 (s)", "{:.2f}"),
        ("sim_ttft_p90", "sim TTFT\np90 (s)", "{:.2f}"),
        ("live_reuse_total", "live\nreuse", "{:.0%}"),
        ("sim_reuse_total", "sim\nreuse", "{:.0%}"),
        ("live_requests", "live\nrequests", "{:.0f}"),
        ("live_lost_max", "lost", "{}"),
        ("loadavg_1m_max", "load\n1m", "{:.1f}"),
    ]
    for _k, head, _f in cols:
        t.add_column(
            head, justify="left" if _k in ("config", "sim_policy") else "right", no_wrap=_k == "config"
        )
    for r in rows:
        t.add_row(*[fmt_cell(r.get(k), f) for k, _h, f in cols])
    console.print(t)
    if order is not None:
        console.print(
            f"ordering by prefill TPS within SLO: live {' > '.join(order['live_order'])}\n"
            f"                                    sim  {' > '.join(order['sim_order'])}\n"
            f"pairwise agreement {fmt_cell(order['agreement'], '{:.0%}')}; discordant pairs beyond noise: "
            f"{order['discordant_beyond_noise']}, within noise: {order['discordant_within_noise']}"
        )
    console.print(
        "TTFTs and TPS in modelled seconds (wall / time factor); sim counterparts of sglang-router's "
        "policies are approximations (compare.json: sim_note)."
    )


def run(args: argparse.Namespace) -> int:
    from stack.policies import POLICIES
    from stack.traces.load import load_trace

    ours = _split(args.policies)
    peers = _split(args.peer_policies)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(args.trace)
    show = not args.no_progress and sys.stderr.isatty()
    configs = [("smetric", p) for p in ours] + [("sglang-router", p) for p in peers]

    def _term(signum, frame):  # SIGTERM: stop the pools and routers started so far, as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    if args.resim:
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
            key = f"{'ours' if c[0] == 'smetric' else 'sglang-router'}:{c[1]}"
            runs[c] = list(stored.get(key) or stored.get(f"{c[0]}:{c[1]}") or [])
        configs = [c for c in configs if runs[c]]
        if not configs:
            raise ValueError(f"no stored runs of these configurations under {out}")
        trace = load_trace(args.trace)
    first = 0
    requested = list(configs)
    if args.append and not args.resim and (out / "compare.json").exists():
        old = orjson.loads((out / "compare.json").read_bytes())
        for k in _RUN_SETTINGS:
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
    for rep in range(first, first + (0 if args.resim else args.repeat)):
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
    sims: dict[tuple[str, str], dict | None] = {}
    rows = []
    for c in configs:
        router, pol = c
        if router == "smetric":
            sp, params, note = pol, {}, "same policy object"
        elif pol in SIM_COUNTERPARTS:
            sp, params, note = SIM_COUNTERPARTS[pol]
        else:
            sp, params, note = None, {}, "no sim counterpart"
        sim = None
        if sp is not None and not args.no_sim:
            r0 = runs[c][0]
            sim = sim_run(args, sp, params, trace, r0.get("hardware") or "h20", r0.get("capacity_tokens"))
            sim["policy_params"] = params
        sims[c] = sim
        rows.append(aggregate(runs[c], sim, sp, note))
    order = None if args.no_sim else ordering(rows)
    title = (
        f"{Path(args.trace).name}: {args.prefill} prefill + {args.decode} decode emulated workers, "
        f"{args.session_rate} sessions/s for {args.duration:.0f} s (modelled), time factor {args.time_factor}, "
        f"{max(len(v) for v in runs.values())} run(s) each"
    )
    result = {
        "settings": {
            k: getattr(args, k) for k in ("trace", *_RUN_SETTINGS, "request_timeout", "repeat", "no_mooncake")
        },
        "sglang_router_version": _sglang_router_version(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "ordering": order,
        "runs": {f"{'ours' if r == 'smetric' else 'sglang-router'}:{p}": v for (r, p), v in runs.items()},
        "sim": {f"{'ours' if r == 'smetric' else 'sglang-router'}:{p}": v for (r, p), v in sims.items()},
    }
    (out / "compare.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    write_csv(rows, out / "compare.csv")
    plot(rows, out / "compare.png", title)
    print_table(rows, title, order)
    print(f"wrote {out / 'compare.json'}, {out / 'compare.csv'}, {out / 'compare.png'}")
    return 0


def _sglang_router_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang-router")
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:  # `python -m stack.commands.compare`
    p = argparse.ArgumentParser(prog="smetric compare", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
