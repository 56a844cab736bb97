"""The simulator held against a real engine: SGLang 0.5.23 CPU workers, calibrated, replayed, simulated.

One command does it all (docs/research/simulator.md, "Against a real engine"):

    python benchmarks/sglang_fidelity.py --out DIR [--runs 2]

1. Builds (or reuses, cached under ~/.cache/smetric) the random-weight `small` Llama
   (tests/sglang_cpu/build_tiny_llama.py: hidden 1024, 8 layers, 8192 positions; no hub).
2. Calibrates: one plain SGLang worker with the prefill worker's flags (`--enable-metrics`, one
   compute thread pinned to CPU 0), `smetric calibrate` against it (engine-side timings), stopped.
   Writes DIR/calibration.yaml (held-out MAPE in its `calibration:` section).
3. Writes a synthetic append-only session trace (DIR/sessions.jsonl, agentic format: each
   follow-up appends a few 64-token blocks to its predecessor's prompt), sized so a prefill
   takes ~0.1-2 s on this model.
4. Starts 1 prefill + 1 decode SGLang worker (`mooncake_tcp`, one compute thread each, pinned
   to CPU 0 and CPU 1) and `smetric router` in front, and replays the sessions through the
   router (`smetric replay`'s driver: streamed chat completions, Poisson session starts, closed
   loop) `--runs` times, flushing both workers' caches between runs.
5. Simulates the same arrivals (`stack.sim`, the same trace, load and seed, 1 prefill instance)
   with `--hardware DIR/calibration.yaml` and the same SLO, and prints real against simulated:
   TTFT p50/p90/p99, prefill TPS within SLO, share past 5x SLO. DIR/fidelity.json has all of it.

The SLO is the default's shape scaled to this engine: ``b`` = ``--slo-b`` seconds and ``a`` =
the default's per-token SLO over h20's ``c_linear`` (1.42) times the fitted ``c_linear``.

Needs the SGLang interpreter (tests/sglang_cpu/_locate.py finds it) and `taskset`.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "sglang_cpu"))

from _locate import sglang_python  # noqa: E402
from harness import start, stop_all, wait_ready  # noqa: E402

from stack.core.cost_model import load_hardware  # noqa: E402
from stack.core.types import SLO  # noqa: E402
from stack.ports import free_port  # noqa: E402

BLOCK = 64
PAGE = 16
STARTUP_S = 600.0
#: the default SLO's per-token term over h20's c_linear (62.5e-6 / 4.4e-5)
SLO_A_RATIO = 62.5e-6 / 4.4e-5
ADMIN = "sglang-fidelity-admin"


def build_model(py: str, size: str) -> Path:
    r = subprocess.run(
        [py, str(ROOT / "tests" / "sglang_cpu" / "build_tiny_llama.py"), "--cached", "--size", size],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if r.returncode != 0:
        raise SystemExit(f"building the {size} model failed:\n{r.stderr[-3000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def prepare(out: Path, size: str) -> tuple[str, Path]:
    """The SGLang interpreter and the ``size`` model (built or reused), ``out`` made; exits
    with a message when SGLang or ``taskset`` is missing."""
    py = sglang_python()
    if py is None:
        raise SystemExit("no interpreter with sglang (tests/sglang_cpu/README.md)")
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin each worker to its core")
    out.mkdir(parents=True, exist_ok=True)
    return py, build_model(py, size)


def launch_config(
    py: str,
    model: Path,
    run_dir: Path,
    context: int,
    hardware: str | None,
    health_s: float = 1.0,
    record_dir: Path | None = None,
) -> dict:
    """1 prefill (metrics on) + 1 decode over mooncake_tcp, our router in front (smetric policy).
    ``health_s``: the router's health-check period (SGLang's /health runs a one-token forward)."""
    router = {
        "host": "127.0.0.1",
        "port": free_port(),
        "policy": "smetric",
        "health_interval_s": health_s,
        "health_timeout_s": 30.0,
        "health_failures": 5,
        # the router reads each prefill's engine timings (queue, forward) from the prefill
        # half's meta_info and keeps them (GET /admin/cost_model/observations); it still prices
        # with router.hardware
        "cost_model": "observe",
        "admin_token_env": "SMETRIC_FIDELITY_ADMIN",
    }
    if hardware:
        router["hardware"] = hardware
    if record_dir is not None:  # what it serves, with each prefill's own timing (--fit-under-load)
        router["record"] = {"enabled": True, "dir": str(record_dir)}
    return {
        "model": {"name": "tiny", "path": str(model), "page_size": PAGE, "context_length": context},
        "router": router,
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": py,
            "run_dir": str(run_dir),
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 1,
                "port": free_port(),
                "bootstrap_port": free_port(),
                "kv_events_port": free_port(),
                "transfer_backend": "mooncake_tcp",
                "metrics": True,
            },
            "decode": {"count": 1, "port": free_port(), "transfer_backend": "mooncake_tcp"},
            "mooncake_master": None,
            "router": {"command": [sys.executable, "-m", "stack.cli"], "node": "local"},
        },
    }


def pin(spec, cpu: str) -> None:
    """One compute thread, on ``cpu`` (the two workers do not fight over the cores)."""
    spec.argv = ["taskset", "-c", cpu, *spec.argv]
    spec.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})


def calibrate(py: str, model: Path, out: Path, context: int, design: list[str]) -> Path:
    """A plain worker with the prefill worker's flags, pinned to CPU 0; `smetric calibrate`."""
    import copy

    from stack.launch.sglang import sglang_process_specs

    cfg = launch_config(py, model, out / "run-calibrate", context, None)
    c = copy.deepcopy(cfg)
    port = free_port()
    c["launch"]["prefill"] = {"count": 1, "port": port, "disaggregation": False, "metrics": True}
    c["launch"]["decode"] = {"count": 0}
    c["launch"]["router"] = False
    [spec] = sglang_process_specs(c)
    spec.name = "calibrate-0"
    pin(spec, "0")
    proc = start(spec, out / "logs")
    try:
        wait_ready([proc], timeout=STARTUP_S)
        return run_calibrate(f"http://127.0.0.1:{port}", out / "calibration.yaml", design)
    finally:
        stop_all([proc])


def run_calibrate(url: str, path: Path, design: list[str]) -> Path:
    argv = [sys.executable, "-m", "stack.cli", "calibrate", "--target", url, "--out", str(path), *design]
    r = subprocess.run(argv, text=True)
    if r.returncode != 0:
        raise SystemExit(f"smetric calibrate failed ({r.returncode})")
    return path


def run_handoff(url: str, path: Path, source: list[str], design: list[str]) -> Path:
    """`smetric calibrate --handoff` through the router: the PD hand-off measured on the pair,
    the prefill priced by ``source`` (``--base FILE``: a calibration; ``--from FILE``: the
    router's observations of the prefill worker's own timings, fitted)."""
    keep = _option(design, "--token-ids")  # the same vocabulary range as the sweep
    argv = [sys.executable, "-m", "stack.cli", "calibrate", *source, "--handoff", url, "--out", str(path)]
    # 8 lengths x 4 repeats: with 6 x 2 the fit moved from 10 ms + 0 per token to 17-19 ms +
    # 32-37 us per token between runs on the same quiet pair (docs/research/simulator.md)
    argv += [
        "--plot",
        "none",
        "--repeats",
        "4",
        "--handoff-levels",
        "8",
        "--min-new",
        "64",
        "--handoff-max",
        "1024",
    ]
    argv += keep
    r = subprocess.run(argv, text=True)
    if r.returncode != 0:
        raise SystemExit(f"smetric calibrate --handoff failed ({r.returncode})")
    return path


def _option(argv: list[str], name: str) -> list[str]:
    """``name`` and its value out of ``argv`` (the calibration design's options), or []."""
    i = argv.index(name) if name in argv else -1
    return argv[i : i + 2] if i >= 0 else []


def make_trace(path: Path, sessions: int, seed: int, first: tuple[int, int], turns: tuple[int, int]) -> Path:
    """Append-only sessions (agentic format): a first prompt of ``first`` blocks, then follow-ups
    each appending 1-3 blocks (the previous answer and a tool result); short answers."""
    rng = random.Random(seed)
    rows, next_id = [], 1
    for s in range(sessions):
        n = rng.randint(*first)
        ids = list(range(next_id, next_id + n))
        next_id += n
        t = 0.0
        for turn in range(1, rng.randint(*turns) + 1):
            if turn > 1:
                k = rng.randint(1, 3)
                ids += list(range(next_id, next_id + k))
                next_id += k
            think = 0.0 if turn == 1 else round(rng.uniform(0.5, 3.0), 3)
            t += think
            rows.append(
                {
                    "session_id": s,
                    "agent": "main",
                    "timestamp": round(10.0 * s + t, 3),
                    "t_in_session": round(t, 3),
                    "input_length": len(ids) * BLOCK,
                    "output_length": rng.randint(8, 24),
                    "n_blocks": len(ids),
                    "hash_id_ranges": [[ids[0], ids[-1]]],
                    "think_time": think,
                    "turn": turn,
                }
            )
    with gzip.open(path, "wt") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def as_sent(trace_path: Path, model: Path, path: Path) -> Path:
    """``trace_path`` with each request's new tokens as the engine gets them: the replay sends
    chat requests (stack/replay/builder.py: a fresh conversation, or the previous turn's
    messages plus an answer and the next user message), and the model's chat template adds
    tokens to each (8 to a fresh conversation, 10 to each appended turn on this model). Each
    request's ``input_length`` gains the template tokens of its own new messages, counted
    with the router's tokenizer on the built request; the ones of earlier turns are in the
    cached prefix the engine reuses (the simulator's block hits cover the trace's tokens
    only, so adding them too would count them as new)."""
    from stack.prefill_router.tokenizer import Tokenizer
    from stack.replay.builder import Built, Conversations, Vocab, read_block_ids
    from stack.traces.load import load_trace

    trace = load_trace(str(trace_path))
    ids, fmt = read_block_ids(trace_path)
    conv = Conversations(ids, fmt, trace.block_size, Vocab.from_tokenizer(model), len(trace.sessions))
    tok = Tokenizer(model)
    built: dict[int, tuple[Built, int]] = {}
    extra: list[int] = []
    for r in trace.requests:
        prev = built.get(r.prev) if r.prev >= 0 else None
        prev_out = trace.requests[r.prev].output_len if r.prev >= 0 else 0
        b = conv.build(0, r.idx, prev[0] if prev else None, r.prev, prev_out)
        n = len(tok.encode(tok.render(b.messages), add_special_tokens=False).tokens)
        built[r.idx] = (b, n)
        appended = prev is not None and len(b.messages) > 1
        # the template tokens of this turn's own messages: all of them in a fresh conversation
        own = n - r.input_len - ((prev[1] - trace.requests[r.prev].input_len) if appended else 0)
        extra.append(max(0, own))
    with gzip.open(trace_path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    assert len(rows) == len(extra)
    with gzip.open(path, "wt") as fh:
        for row, k in zip(rows, extra, strict=True):
            row["input_length"] += k
            fh.write(json.dumps(row) + "\n")
    return path


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


@contextlib.contextmanager
def pd_stack(
    py: str,
    model: Path,
    out: Path,
    context: int,
    hw: Path | None,
    health_s: float = 1.0,
    record_dir: Path | None = None,
):
    """The PD pair (prefill pinned to CPU 0, decode to CPU 1) with our router (recording into
    ``record_dir`` if given): yields (router URL, worker URLs)."""
    import yaml

    from stack.launch.sglang import resolved_config, router_config_path, sglang_process_specs

    cfg = launch_config(py, model, out / "run-pd", context, str(hw) if hw else None, health_s, record_dir)
    specs = sglang_process_specs(cfg)
    path = Path(router_config_path(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
    workers = [s for s in specs if s.role in ("prefill", "decode")]
    for s in workers:
        pin(s, "0" if s.role == "prefill" else "1")
    procs = [start(s, out / "logs") for s in workers]
    router = None
    try:
        wait_ready(procs, timeout=STARTUP_S)
        router = start(
            next(s for s in specs if s.role == "router"), out / "logs", {"SMETRIC_FIDELITY_ADMIN": ADMIN}
        )
        wait_ready([router], timeout=120)
        urls = [f"http://127.0.0.1:{s.ready_port}" for s in workers]
        yield f"http://127.0.0.1:{cfg['router']['port']}", urls
    finally:
        stop_all(([router] if router else []) + procs)


def idle_probe(url: str, hw: Path, model: Path, sizes=(64, 256, 512, 1024)) -> list[dict]:
    """One request at a time through the router (idle pair): the client's time to the first
    (only) token against the calibration's prefill cost of the same prompt. The difference is
    what PD adds on this path and the simulator does not model: router, tokenizer, bootstrap,
    KV transfer, the decode worker's first step, HTTP."""
    import httpx

    cost = load_hardware(str(hw)).cost
    rng = random.Random(7)
    out = []
    for n in sizes:
        ids = [rng.randrange(10, 500) for _ in range(n)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        t0 = time.monotonic()
        r = httpx.post(url + "/generate", json=body, timeout=300)
        wall = time.monotonic() - t0
        r.raise_for_status()
        pt = int((r.json().get("meta_info") or {}).get("prompt_tokens") or n)
        pred = cost.cost(pt, pt)
        out.append({"prompt_tokens": pt, "client_s": wall, "model_prefill_s": pred, "extra_s": wall - pred})
        print(f"idle probe: {pt} tokens, client {wall:.3f} s, modelled prefill {pred:.3f} s", flush=True)
    return out


def observations(url: str) -> list[dict]:
    """The router's record of every prefill's engine timings so far (JSON lines)."""
    import httpx

    r = httpx.get(
        url + "/admin/cost_model/observations", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    r.raise_for_status()
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def engine_side(rows: list[dict], hw: Path) -> dict:
    """What the prefill worker's own clock says of a run's prefills: queue and forward seconds
    (p50/p90) and the calibration's error on the forwards (MAPE; lone ones apart)."""
    from stack.stats import percentile

    cost = load_hardware(str(hw)).cost

    def pct(xs: list[float], q: float) -> float | None:
        return percentile(sorted(xs), q) if xs else None

    def bias(rs: list[dict]) -> float | None:  # mean of modelled / measured - 1 (< 0: slower than modelled)
        errs = [
            cost.cost(r["new_tokens"], r["new_tokens"] + r["cached_tokens"]) / r["forward_s"] - 1
            for r in rs
            if r["forward_s"] > 0
        ]
        return sum(errs) / len(errs) if errs else None

    def mape(rs: list[dict]) -> float | None:
        errs = [
            abs(cost.cost(r["new_tokens"], r["new_tokens"] + r["cached_tokens"]) / r["forward_s"] - 1)
            for r in rs
            if r["forward_s"] > 0
        ]
        return sum(errs) / len(errs) if errs else None

    fwd = [r["forward_s"] for r in rows]
    q = [r.get("queue_s", 0.0) for r in rows]
    both = [a + b for a, b in zip(fwd, q)]
    alone = [r for r in rows if r.get("alone", True)]
    return {
        "prefills": len(rows),
        "alone": len(alone),
        "forward_p50": pct(fwd, 0.5),
        "forward_p90": pct(fwd, 0.9),
        "queue_p50": pct(q, 0.5),
        "queue_p90": pct(q, 0.9),
        "queue_forward_p50": pct(both, 0.5),
        "queue_forward_p90": pct(both, 0.9),
        "model_mape_all": mape(rows),
        "model_mape_alone": mape(alone),
        "model_bias_alone": bias(alone),
        "rows": rows,
    }


def replay_once(
    url: str, workers: list[str], model: Path, a: argparse.Namespace, trace: Path, seed: int
) -> tuple[dict, list[dict]]:
    """One replay of ``trace`` at ``seed``'s arrivals through the router at ``url``, from cold
    caches: its metrics, and the router's observations of its prefills."""
    from stack.replay.driver import ReplayConfig, run_replay

    for w in workers:  # every run starts from cold caches
        _post(w + "/flush_cache")
    rc = ReplayConfig(
        target=url,
        trace=str(trace),
        load=load_spec(a, seed),
        request_timeout=a.request_timeout,
        slo=a.slo_obj,
        tokenizer=str(model),
    )
    seen = len(observations(url))
    res = run_replay(rc)
    return res, observations(url)[seen:]


def router_side(rec_dir: Path, since_ms: float, warmup_s: float) -> dict:
    """The router's own times to first token of one run (its recording's lines since
    ``since_ms``, arrivals in the replay's warm-up left out), beside the client's: what the
    client's side adds on this machine (it shares the two cores with the workers)."""
    from stack.stats import percentile
    from stack.traces.load import recording_lines

    start = since_ms + 1000 * warmup_s
    t = sorted(
        r["ttft_ms"] / 1000
        for r in recording_lines(rec_dir)
        if r.get("timestamp", 0) >= start and r.get("ttft_ms") is not None and r.get("outcome") == "ok"
    )
    return {"router_ttft_p50": percentile(t, 0.5), "router_ttft_p90": percentile(t, 0.9)} if t else {}


def fit_under_load(url: str, workers: list[str], model: Path, a: argparse.Namespace, base: Path) -> Path:
    """The pair calibrated as it runs the traffic (``--fit-under-load``): one replay of other
    sessions (the trace and arrivals at ``--seed`` + 1, which the scored runs never see), then
    ``smetric calibrate --from`` its prefills as the prefill worker timed them (the lone ones)
    ``--handoff-from`` the router's recording of it (each first token less the router's queue
    and the prefill worker's queue and forward, binned by length, each bin's median)."""
    from stack.traces.load import recording_lines

    seed = a.seed + 1
    trace = make_trace(
        a.out / "sessions-fit.jsonl.gz", a.sessions, seed, _range(a.first_blocks), _range(a.turns)
    )
    since_ms = time.time() * 1000
    res, obs = replay_once(url, workers, model, a, trace, seed)
    print(f"fitting run (seed {seed}): {summary_line(res)}", flush=True)
    time.sleep(1.0)  # the recorder writes every 0.2 s
    lines = [r for r in recording_lines(a.out / "recording") if r.get("timestamp", 0) >= since_ms]
    rec = a.out / "fit-recording.jsonl"
    rec.write_text("".join(json.dumps(r) + "\n" for r in lines))
    obs_path = a.out / "fit-observations.jsonl"
    obs_path.write_text("".join(json.dumps(r) + "\n" for r in obs))
    return calibrate_under_load(obs_path, rec, base, a.out / "calibration-load.yaml", a)


def calibrate_under_load(obs: Path, rec: Path, base: Path, path: Path, a: argparse.Namespace) -> Path:
    """``smetric calibrate --from OBS --handoff-from REC --base BASE --out PATH``."""
    hold = _option(a.calibrate_args.split(), "--holdout-every")
    argv = [sys.executable, "-m", "stack.cli", "calibrate", "--from", str(obs), "--base", str(base)]
    argv += ["--handoff-from", str(rec), "--out", str(path), "--plot", "none", *hold]
    r = subprocess.run(argv, text=True)
    if r.returncode != 0:
        raise SystemExit(f"smetric calibrate --from --handoff-from failed ({r.returncode})")
    return path


def resimulate(a: argparse.Namespace) -> int:
    """``--resimulate DIR``: a saved ``--fit-under-load`` invocation simulated again with this
    code, against its own real runs (no engine runs). Its fitting run's files are fitted again
    (``calibrate_under_load``) and both simulations run on its trace at its SLO; the saved
    ``calibration-pd.yaml`` is simulated as it was written."""
    src: Path = a.resimulate
    saved = json.loads((src / "fidelity.json").read_text())
    if not saved.get("sim_fitted_under_load"):
        raise SystemExit(f"{src}: not a --fit-under-load invocation (nothing to fit again)")
    kept = {k: saved["args"][k] for k in ("session_rate", "duration", "warmup", "seed", "calibrate_args")}
    for k, v in kept.items():
        setattr(a, k, v if k == "calibrate_args" else type(getattr(a, k))(v))
    a.trace_path = src / "sessions.jsonl.gz"
    a.slo_obj = SLO(b=saved["slo"]["b"], a=saved["slo"]["a"])
    _, model = prepare(a.out, saved["args"].get("size", "small"))
    a.sim_trace_path = as_sent(a.trace_path, model, a.out / "sessions-as-sent.jsonl.gz")
    hw_pd = src / "calibration-pd.yaml"
    obs, rec = src / "fit-observations.jsonl", src / "fit-recording.jsonl"
    hw_load = calibrate_under_load(obs, rec, hw_pd, a.out / "calibration-load.yaml", a)
    sim, sim_load = simulate(a, hw_pd), simulate(a, hw_load)
    report = table(saved["real"], sim, None, sim_load)
    print(report)
    res = {
        "resimulated_from": str(src),
        "calibration_pd": str(hw_pd),
        "calibration_load": str(hw_load),
        "sim_fitted_under_load": sim_load,
        "sim": sim,
        "slo": saved["slo"],
        "real": saved["real"],
        "table": report,
    }
    (a.out / "fidelity.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


def fitted_under_load(
    url: str, workers: list[str], model: Path, a: argparse.Namespace, base: Path
) -> tuple[Path, dict]:
    """:func:`fit_under_load`, then the simulation on that file at the scored runs' SLO (the
    one ``base`` set, ``a.slo_obj``: every simulation and run is held to the same SLO)."""
    path = fit_under_load(url, workers, model, a, base)
    sim = simulate(a, path)
    print(f"sim, fitted under load: {summary_line(sim)}", flush=True)
    return path, sim


def replay_runs(url: str, workers: list[str], model: Path, a: argparse.Namespace) -> list[dict]:
    """``a.runs`` replays through the router at ``url`` (the workers' caches flushed before each)."""
    runs = []
    for i in range(a.runs):
        t0 = time.monotonic()
        since_ms = time.time() * 1000
        res, obs = replay_once(url, workers, model, a, a.trace_path, a.seed)
        res["engine"] = engine_side(obs, a.hw_path)
        if a.fit_under_load:  # the router records: its own TTFT beside the client's
            time.sleep(1.0)  # the recorder writes every 0.2 s
            res.update(router_side(a.out / "recording", since_ms, a.warmup))
        res["run"] = i + 1
        res["wall_run_s"] = time.monotonic() - t0
        runs.append(res)
        print(f"real run {i + 1}: {summary_line(res)}", flush=True)
        eng = {k: v for k, v in res["engine"].items() if k != "rows"}
        print(f"  prefill worker's clock: {json.dumps(eng)}", flush=True)
    return runs


def load_spec(a: argparse.Namespace, seed: int | None = None):
    from stack.sim.load import LoadSpec

    return LoadSpec(
        mode="sessions",
        session_rate=a.session_rate,
        duration=a.duration,
        warmup=a.warmup,
        seed=a.seed if seed is None else seed,
    )


def simulate_with(a: argparse.Namespace, hw: Path) -> dict:
    """The SLO scaled to the calibration (module docstring), then the simulation."""
    a.hw_path = hw
    h = load_hardware(str(hw))
    a.slo_obj = SLO(b=a.slo_b, a=SLO_A_RATIO * h.cost.c_linear)
    print(f"SLO: {a.slo_obj.b:g} s + {a.slo_obj.a * 1000:.3g} ms/token; trace {a.trace_path}", flush=True)
    sim = simulate(a, hw)
    print(f"sim: {summary_line(sim)}", flush=True)
    return sim


def simulate_pair(a: argparse.Namespace, hw: Path, hw_pd: Path) -> tuple[dict, dict]:
    """The simulation without the hand-off (``hw``) and with it (``hw_pd``), at the SLO of
    ``hw_pd`` (the one the replay is scored at)."""
    plain = simulate_with(a, hw)
    sim = simulate_with(a, hw_pd)
    return plain, sim


def simulate(a: argparse.Namespace, hw: Path) -> dict:
    from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
    from stack.traces.load import load_trace

    h = load_hardware(str(hw))
    cfg = SimConfig(instances=1, hardware=h, global_tier=GlobalTierSpec("none"), slo=a.slo_obj)
    trace = load_trace(str(getattr(a, "sim_trace_path", None) or a.trace_path))
    return Simulator(trace, "smetric", cfg, load_spec(a)).run().metrics


FIELDS = (
    ("requests", "{:.0f}"),
    ("ttft_p50", "{:.3f}"),
    ("ttft_p90", "{:.3f}"),
    ("ttft_p99", "{:.3f}"),
    # the first chunk with visible text (the replay's ttft_text_*): later than the first token
    # when the detokenizer holds back incomplete UTF-8; set against the simulated TTFT too
    ("ttft_text_p50", "{:.3f}"),
    ("ttft_text_p90", "{:.3f}"),
    # the router's own TTFT (from its recording, --fit-under-load): the client's less the last
    # hop and the client's own delay in reading it
    ("router_ttft_p50", "{:.3f}"),
    ("router_ttft_p90", "{:.3f}"),
    ("prefill_tps_within_slo", "{:.1f}"),
    ("slo_attainment", "{:.3f}"),
    ("over_5x_slo", "{:.3f}"),
)
#: the simulator's figure a real row is set against, where its name differs
SIM_KEY = {
    "ttft_text_p50": "ttft_p50",
    "ttft_text_p90": "ttft_p90",
    "router_ttft_p50": "ttft_p50",
    "router_ttft_p90": "ttft_p90",
}


def summary_line(m: dict) -> str:
    return ", ".join(f"{k} {_cell(m.get(k), f)}" for k, f in FIELDS) + f", errors {m.get('errors')}"


def _cell(v, f: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)


def table(runs: list[dict], sim: dict, plain: dict | None = None, load: dict | None = None) -> str:
    """Real runs beside the simulation (with the measured hand-off, without it when ``plain``
    is given, and with the pair calibrated under load when ``load`` is); the gap columns are
    each simulation's error against the real runs' mean (sim / real - 1)."""
    sims = [("sim, fitted under load", load)] if load is not None else []
    sims += [("sim", sim)] + ([("sim, no hand-off", plain)] if plain is not None else [])
    head = ["metric"] + [f"real {r['run']}" for r in runs]
    for name, _ in sims:
        head += [name, f"{name} vs real mean"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for k, f in FIELDS:
        vals = [r.get(k) for r in runs]
        ok = [v for v in vals if v is not None]
        mean = sum(ok) / len(ok) if ok else None
        row = [k] + [_cell(v, f) for v in vals]
        for _, m in sims:
            s = m.get(SIM_KEY.get(k, k))
            row += [_cell(s, f), f"{s / mean - 1:+.1%}" if s is not None and mean else "-"]
        lines.append(" | ".join(row))
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--size", default="small", choices=("tiny", "small"), help="model shape (default small)")
    p.add_argument("--context", type=int, default=8192, help="the workers' --context-length")
    p.add_argument("--runs", type=int, default=2, help="real replays (caches flushed between)")
    p.add_argument("--calibration", type=Path, default=None, help="reuse this calibration file")
    p.add_argument(
        "--calibrate-through-router",
        action="store_true",
        help="calibrate the PD pair through the router (client-side timing), one group of workers "
        "for both steps (the CPU tier's quick form), instead of a plain worker first",
    )
    p.add_argument(
        "--calibrate-args",
        default="--max-context 2048 --new-levels 7 --cached-levels 5 --holdout-every 3 --repeats 2 "
        "--decode-contexts 2 --token-ids 10:500",
        help="the design options passed to smetric calibrate",
    )
    p.add_argument(
        "--fit-under-load",
        action="store_true",
        help="also calibrate the pair as it runs the traffic: one replay of other sessions (seed "
        "+ 1) recorded by the router, the prefill fitted from its lone prefills' engine timings "
        "and the hand-off from its recorded first tokens (calibrate --from --handoff-from); the "
        "table gains that simulation",
    )
    p.add_argument(
        "--resimulate",
        type=Path,
        default=None,
        metavar="DIR",
        help="no engine runs: simulate the saved --fit-under-load invocation in DIR again with "
        "this code (its fitting run's observations and recording fitted again, its trace, SLO "
        "and real runs as saved), and write the table to --out",
    )
    p.add_argument("--sessions", type=int, default=40, help="sessions in the synthetic trace")
    p.add_argument("--first-blocks", default="4:10", help="first prompt, in 64-token blocks: lo:hi")
    p.add_argument("--turns", default="3:6", help="turns per session: lo:hi")
    p.add_argument("--session-rate", type=float, default=0.12, help="session starts per second")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of session arrivals")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds excluded from the metrics")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace and the arrivals")
    p.add_argument("--slo-b", type=float, default=0.5, help="TTFT SLO's fixed part (s)")
    p.add_argument(
        "--health-s",
        type=float,
        default=30.0,
        help="the router's health-check period (s): SGLang's /health runs a one-token forward, "
        "~0.1 s on this CPU model, which the simulator does not model",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="wall seconds per request")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be >= 1")
    return a


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.resimulate is not None:
        return resimulate(a)
    py, model = prepare(a.out, a.size)
    a.trace_path = make_trace(
        a.out / "sessions.jsonl.gz", a.sessions, a.seed, _range(a.first_blocks), _range(a.turns)
    )
    a.sim_trace_path = as_sent(a.trace_path, model, a.out / "sessions-as-sent.jsonl.gz")
    design = a.calibrate_args.split()
    probe: list[dict] = []
    rec_dir = a.out / "recording" if a.fit_under_load else None
    hw_load: Path | None = None
    sim_load: dict | None = None
    if a.calibrate_through_router:  # one group of workers: calibrate the pair, then replay
        with pd_stack(py, model, a.out, a.context, a.calibration, a.health_s, rec_dir) as (url, workers):
            client = ["--timing", "client", *design]
            hw = a.calibration or run_calibrate(url, a.out / "calibration.yaml", client)
            # the sweep's prefills as the prefill worker timed them (the router observed them):
            # the engine-side prefill model, and the hand-off measured on top of it
            obs = a.out / "observations.jsonl"
            obs.write_text("".join(json.dumps(r) + "\n" for r in observations(url)))
            hw_pd = run_handoff(url, a.out / "calibration-pd.yaml", ["--from", str(obs)], design)
            sim_plain, sim = simulate_pair(a, hw, hw_pd)
            if a.fit_under_load:
                hw_load, sim_load = fitted_under_load(url, workers, model, a, hw_pd)
            runs = replay_runs(url, workers, model, a)
    else:
        hw = a.calibration or calibrate(py, model, a.out, a.context, design)
        with pd_stack(py, model, a.out, a.context, hw, a.health_s, rec_dir) as (url, workers):
            probe = idle_probe(url, hw, model)
            hw_pd = run_handoff(url, a.out / "calibration-pd.yaml", ["--base", str(hw)], design)
            sim_plain, sim = simulate_pair(a, hw, hw_pd)
            if a.fit_under_load:
                hw_load, sim_load = fitted_under_load(url, workers, model, a, hw_pd)
            runs = replay_runs(url, workers, model, a)
    report = table(runs, sim, sim_plain, sim_load)
    print(report)
    res = {
        "calibration": str(hw),
        "calibration_pd": str(hw_pd),
        "sim_without_handoff": sim_plain,
        "calibration_load": str(hw_load) if hw_load else None,
        "sim_fitted_under_load": sim_load,
        "slo": {"b": a.slo_obj.b, "a": a.slo_obj.a},
        "args": {k: str(v) for k, v in vars(a).items() if k not in ("slo_obj", "hw_path")},
        "idle_probe": probe,
        "real": runs,
        "sim": sim,
        "table": report,
    }
    text = json.dumps(res, indent=1, default=str)
    # the home directory as "~", so the file names no machine's path when it is kept in docs/results
    (a.out / "fidelity.json").write_text(text.replace(str(Path.home()) + "/", "~/"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
