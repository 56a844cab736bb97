"""A second, independent client: NVIDIA's aiperf next to `smetric replay` on the same requests.

    python benchmarks/aiperf_crosscheck.py [--repeat 2] [--policy smetric] [--out out/aiperf-crosscheck]

1. aiperf (PyPI ``aiperf==0.13.0``) goes into its own venv (``--venv``, default
   /opt/aiperf-venv; created when missing) so its dependencies never touch the project's.
2. The shipped agentic slice is exported in the Mooncake format (``smetric trace-export``,
   512-token hash_ids), and a window of it (``--window-start``/``--window`` trace seconds)
   becomes the cross-check file: timestamps compressed ``--compress`` times and multiplied by
   the emulator's time factor (so they are wall milliseconds, what aiperf's fixed schedule
   reads), session fields dropped (every line an independent request whose prefix sharing
   is carried by its hash_ids alone: aiperf would otherwise *append* earlier turns to a
   session's prompt, while our export's input_length already holds the whole context), a
   fresh hash id for a partial last block and input_length rounded up to whole 512-token
   blocks (both clients then send exactly ``len(hash_ids) * 512`` tokens).
3. For each client and repeat, a fresh local PD stack (``smetric up``: emulated workers,
   our router with ``--policy``; caches cold) and one replay of that file:
   - aiperf: ``aiperf profile --custom-dataset-type mooncake_trace --fixed-schedule``
     (open loop: every request at its timestamp), streaming chat, the stack's tiny local
     tokenizer (``--tokenizer DIR``, HF_HUB_OFFLINE=1: never a hub download),
     ``--use-server-token-count``, ``--extra-inputs ignore_eos:true``;
   - ours: ``smetric replay``'s driver on the same file with ``--load-mode compress``
     (the trace's own clock; with no parent links every request is also open loop),
     ``--rate-scale`` = time factor so that its wall schedule is the file's.
4. Both are summarised from their per-request records with the same definitions (TTFT
   p50/p90 in wall ms; duration = first send to last answer; input, output and request
   throughput over it), and aiperf's own summary figures are printed beside them. Server
   side reuse comes from the prefill workers' /metrics.

Writes OUT/crosscheck.json and prints the table. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack.stats import percentile  # noqa: E402

AIPERF_VERSION = "0.13.0"
BLOCK = 512


def ensure_venv(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if exe.exists():
        return exe
    print(f"creating {venv} with aiperf=={AIPERF_VERSION} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return exe


def export_slice(trace: str, out: Path) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "stack.cli",
            "trace-export",
            trace,
            "--out",
            str(out),
            "--block-size",
            str(BLOCK),
        ],
        check=True,
        env=env,
        cwd=ROOT,
    )
    return out


def crosscheck_file(
    export: Path, out: Path, start_s: float, window_s: float, compress: float, tf: float
) -> dict:
    opener = gzip.open if export.name.endswith(".gz") else open
    with opener(export, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    lo, hi = start_s * 1000.0, (start_s + window_s) * 1000.0
    sel = [r for r in recs if lo <= r["timestamp"] < hi]
    if not sel:
        raise SystemExit(f"no requests in the window [{start_s}, {start_s + window_s}) s")
    fresh = 1 + max((h for r in recs for h in r["hash_ids"]), default=0)
    n_in = 0
    with out.open("w") as f:
        for r in sel:
            hids = list(r["hash_ids"])
            if len(hids) * BLOCK < r["input_length"]:
                hids.append(fresh)  # the partial last block: its own id
                fresh += 1
            n_in += len(hids) * BLOCK
            rec = {
                "timestamp": round((r["timestamp"] - lo) / compress * tf, 3),  # wall ms
                "input_length": len(hids) * BLOCK,
                "output_length": max(1, int(r["output_length"])),
                "hash_ids": hids,
            }
            f.write(json.dumps(rec) + "\n")
    return {
        "requests": len(sel),
        "input_tokens": n_in,
        "output_tokens": sum(max(1, int(r["output_length"])) for r in sel),
        "span_wall_s": (sel[-1]["timestamp"] - lo) / compress * tf / 1000.0,
    }


def pct(xs: list[float], q: float) -> float | None:
    return percentile(sorted(xs), q) if xs else None


def summarize(rows: list[dict]) -> dict:
    """rows: {ok, send_s, end_s, ttft_s, in_tokens, out_tokens} (wall seconds, any origin)."""
    ok = [r for r in rows if r["ok"]]
    if not ok:
        return {"requests": 0, "errors": len(rows)}
    t0 = min(r["send_s"] for r in ok)
    t1 = max(r["end_s"] for r in ok)
    dur = max(1e-9, t1 - t0)
    ttft = [r["ttft_s"] * 1000.0 for r in ok]
    return {
        "requests": len(ok),
        "errors": len(rows) - len(ok),
        "duration_s": dur,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p90_ms": pct(ttft, 0.9),
        "ttft_mean_ms": sum(ttft) / len(ttft),
        "input_tokens": sum(r["in_tokens"] for r in ok),
        "output_tokens": sum(r["out_tokens"] for r in ok),
        "input_tps": sum(r["in_tokens"] for r in ok) / dur,
        "output_tps": sum(r["out_tokens"] for r in ok) / dur,
        "request_rate": len(ok) / dur,
    }


def server_reuse(prefill_urls: list[str]) -> dict:
    """Prompt and cached tokens the prefill workers counted (their /metrics)."""
    import httpx

    from stack.replay.metrics import parse_prometheus

    tot: dict[str, float] = {}
    for u in prefill_urls:
        try:
            for name, _labels, value in parse_prometheus(httpx.get(u + "/metrics", timeout=5).text):
                if name.endswith(("prompt_tokens_total", "cached_tokens_total")):
                    tot[name] = tot.get(name, 0.0) + value
        except Exception as e:  # noqa: BLE001
            tot["error"] = str(e)  # type: ignore[assignment]
    return tot


HF_REPO = "smetric/tiny-model"


def hf_cache_for(tokenizer_dir: str, cache: Path) -> str:
    """Lay the stack's local tiny tokenizer out as a Hugging Face hub-cache entry and return
    its repo id. aiperf 0.13.0 loads tokenizers offline only through the hub cache
    (``snapshot_download(local_files_only=True)``), and its prompt-synthesis worker processes
    force HF_HUB_OFFLINE=1, so a plain directory path fails there; a cache entry works with
    HF_HUB_OFFLINE=1 everywhere and never touches the network."""
    org, name = HF_REPO.split("/")
    repo = cache / f"models--{org}--{name}"
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, snap / f.name)
    return HF_REPO


def run_aiperf(
    exe: Path, target: str, model: str, tokenizer: str, trace: Path, art: Path, timeout: float
) -> dict:
    art.mkdir(parents=True, exist_ok=True)
    cache = art.parent / "hf-cache"
    tokenizer = hf_cache_for(tokenizer, cache)
    cmd = [
        str(exe), "profile",
        "--model", model,
        "--url", target,
        "--endpoint-type", "chat",
        "--streaming",
        "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace",
        "--fixed-schedule",
        "--tokenizer", tokenizer,
        "--use-server-token-count",
        "--extra-inputs", "ignore_eos:true",
        "--request-timeout-seconds", str(int(timeout)),
        "--random-seed", "1",
        "--artifact-dir", str(art),
        "--ui-type", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--export-level", "records",
    ]  # fmt: skip
    # offline: the tokenizer comes from the hub-cache entry made above (HF_HUB_CACHE); HF_ENDPOINT
    # points at a dead loopback port as a second guard against any download
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(cache.resolve()),
        HF_ENDPOINT="http://127.0.0.1:9",
        NO_COLOR="1",
    )
    t0 = time.time()
    with (art / "aiperf.log").open("w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if p.returncode != 0:
        tail = (art / "aiperf.log").read_text()[-3000:]
        raise RuntimeError(f"aiperf failed (exit {p.returncode}):\n{tail}")
    return {"wall_s": time.time() - t0, "cmd": cmd}


def _val(rec: dict, key: str):
    v = (rec.get("metrics") or {}).get(key)
    if isinstance(v, dict):
        v = v.get("value")
    return v


def parse_aiperf(art: Path) -> tuple[list[dict], dict]:
    """Per-request rows from aiperf's records export, and its own summary figures."""
    recs_path = next(art.rglob("profile_export.jsonl"), None)
    summ_path = next(art.rglob("profile_export_aiperf.json"), None)
    if recs_path is None or summ_path is None:
        raise RuntimeError(f"aiperf wrote no profile_export.jsonl / profile_export_aiperf.json under {art}")
    rows = []
    for line in recs_path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta = rec.get("metadata") or {}
        err = rec.get("error")
        ttft = _val(rec, "time_to_first_token")  # ms
        lat = _val(rec, "request_latency")  # ms
        start_ns = meta.get("request_start_ns")
        ok = err is None and ttft is not None and lat is not None and start_ns is not None
        rows.append(
            {
                "ok": ok,
                "send_s": (start_ns or 0) / 1e9,
                "end_s": (start_ns or 0) / 1e9 + (lat or 0) / 1000.0,
                "ttft_s": (ttft or 0) / 1000.0,
                "in_tokens": int(_val(rec, "input_sequence_length") or 0),
                "out_tokens": int(_val(rec, "output_sequence_length") or 0),
            }
        )
    summ = json.loads(summ_path.read_text())

    def pick(key: str, stat: str):
        m = summ.get(key)
        if isinstance(m, dict):
            return m.get(stat)
        for x in summ.get("records", []) if isinstance(summ.get("records"), list) else []:
            if x.get("tag") == key:
                return x.get(stat)
        return None

    own = {
        "ttft_p50_ms": pick("time_to_first_token", "p50"),
        "ttft_p90_ms": pick("time_to_first_token", "p90"),
        "output_tps": pick("output_token_throughput", "avg"),
        "request_rate": pick("request_throughput", "avg"),
        "requests": pick("request_count", "avg"),
        "errors": pick("error_request_count", "avg"),
    }
    return rows, own


def run_ours(target: str, trace: Path, tf: float, tokenizer: str, timeout: float) -> tuple[list[dict], dict]:
    from stack.replay.driver import Replay, ReplayConfig
    from stack.sim.load import LoadSpec

    cfg = ReplayConfig(
        target=target,
        trace=str(trace),
        fmt="mooncake",
        load=LoadSpec(mode="compress", rate_scale=tf, warmup=0.0, measure_until=math.inf),
        time_factor=tf,
        request_timeout=timeout,
        tokenizer=tokenizer,
        metrics_url="",
    )
    rp = Replay(cfg)
    res = asyncio.run(rp.run())
    rows = []
    for o in rp.outcomes:
        ok = o.error is None and o.ttft_wall is not None
        rows.append(
            {
                "ok": ok,
                "send_s": o.sent_wall,
                "end_s": o.sent_wall + (o.e2e_wall or 0.0),
                "ttft_s": o.ttft_wall or 0.0,
                "in_tokens": o.prompt_tokens,
                "out_tokens": o.output_tokens,
            }
        )
    # how late each request left the client against its schedule (prompt building and event-loop
    # lag of this single-process asyncio client; aiperf builds every prompt before the run)
    lag = [(o.sent_wall - o.arrival * tf) * 1000.0 for o in rp.outcomes]
    return rows, {
        "send_lag_p50_ms": pct(lag, 0.5),
        "send_lag_p90_ms": pct(lag, 0.9),
        "send_lag_max_ms": max(lag) if lag else None,
        "ttft_p50_ms": (res.get("ttft_p50_wall") or 0) * 1000.0,
        "ttft_p90_ms": (res.get("ttft_p90") or 0) * tf * 1000.0,
        "requests": res.get("requests_total"),
        "errors": res.get("errors"),
        "reuse_total": res.get("reuse_total"),
    }


def one_run(client: str, a, exe: Path, trace: Path, out: Path, rep: int) -> dict:
    import httpx

    from stack.replay.localstack import local_stack

    load0 = os.getloadavg()
    with local_stack(
        prefill=a.prefill,
        decode=a.decode,
        policy=a.policy,
        ports="auto",
        time_factor=a.time_factor,
        mooncake=not a.no_mooncake and shutil.which("mooncake_master") is not None,
    ) as info:
        si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
        tok = si["tokenizer_path"]
        tf = float((si.get("emulator") or {}).get("time_factor") or a.time_factor)
        model = httpx.get(info["router_url"] + "/v1/models", timeout=10).json()["data"][0]["id"]
        if client == "aiperf":
            meta = run_aiperf(
                exe, info["router_url"], model, tok, trace, out / f"aiperf-r{rep}", a.request_timeout
            )
            rows, own = parse_aiperf(out / f"aiperf-r{rep}")
        else:
            meta = {}
            rows, own = run_ours(info["router_url"], trace, tf, tok, a.request_timeout)
        srv = server_reuse(info["prefill"])
    s = summarize(rows)
    s.update(client=client, repeat=rep, own=own, server=srv, meta=meta)
    s["loadavg_before"] = [round(x, 2) for x in load0]
    s["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    p = sum(v for k, v in srv.items() if k.endswith("prompt_tokens_total"))
    c = sum(v for k, v in srv.items() if k.endswith("cached_tokens_total"))
    s["server_reuse"] = c / p if p else None
    return s


def main() -> int:
    from stack.paths import default_trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.environ.get("AIPERF_VENV", "/opt/aiperf-venv"))
    ap.add_argument("--trace", default=str(default_trace()))
    ap.add_argument("--window-start", type=float, default=0.0, help="trace seconds")
    ap.add_argument("--window", type=float, default=600.0, help="trace seconds")
    ap.add_argument("--compress", type=float, default=0.5, help="trace time / modelled time (<1 stretches)")
    ap.add_argument("--time-factor", type=float, default=0.1, help="emulator wall s per modelled s")
    ap.add_argument("--policy", default="smetric")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="wall seconds")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--clients", default="aiperf,smetric", help="comma-separated: aiperf, smetric")
    ap.add_argument("--out", default=str(ROOT / "out" / "aiperf-crosscheck"))
    a = ap.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    exe = ensure_venv(Path(a.venv))
    export = export_slice(a.trace, out / "slice-mooncake.jsonl")
    trace = out / "crosscheck.jsonl"
    info = crosscheck_file(export, trace, a.window_start, a.window, a.compress, a.time_factor)
    print(
        f"cross-check file {trace}: {info['requests']} requests over {info['span_wall_s']:.0f} wall s "
        f"({info['input_tokens']:,} input, {info['output_tokens']:,} output tokens)",
        file=sys.stderr,
    )
    clients = [c.strip() for c in a.clients.split(",") if c.strip()]
    runs = []
    for rep in range(a.repeat):
        for client in clients if rep % 2 == 0 else list(reversed(clients)):
            r = one_run(client, a, exe, trace, out, rep)
            runs.append(r)
            print(
                f"[{time.strftime('%H:%M:%S')}] {client} run {rep + 1}: {r.get('requests')} ok, "
                f"{r.get('errors')} errors, TTFT p50 {r.get('ttft_p50_ms') or 0:.0f} ms, "
                f"load {r['loadavg_before'][0]:.1f}->{r['loadavg_after'][0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
            (out / "crosscheck.json").write_text(
                json.dumps({"file": info, "settings": vars(a), "runs": runs}, indent=1, default=str)
            )
    hdr = (
        f"{'client':8s} {'run':>3s} {'ok':>5s} {'err':>4s} {'TTFT p50 ms':>12s} {'TTFT p90 ms':>12s} "
        f"{'in tok/s':>10s} {'out tok/s':>10s} {'req/s':>7s} {'reuse':>6s} | {'own: p50':>9s} {'p90':>8s} "
        f"{'out tok/s':>10s} {'load':>9s}"
    )
    print(hdr)
    for r in runs:
        own = r["own"]

        def f(v, fmt):
            return "-" if v is None else format(v, fmt)

        print(
            f"{r['client']:8s} {r['repeat'] + 1:>3d} {r.get('requests', 0):>5d} {r.get('errors', 0):>4d} "
            f"{f(r.get('ttft_p50_ms'), '12.0f')} {f(r.get('ttft_p90_ms'), '12.0f')} "
            f"{f(r.get('input_tps'), '10.0f')} {f(r.get('output_tps'), '10.1f')} {f(r.get('request_rate'), '7.2f')} "
            f"{f(r.get('server_reuse'), '6.0%')} | {f(own.get('ttft_p50_ms'), '9.0f')} "
            f"{f(own.get('ttft_p90_ms'), '8.0f')} {f(own.get('output_tps'), '10.1f')} "
            f"{r['loadavg_before'][0]:4.1f}>{r['loadavg_after'][0]:<4.1f}"
        )
    print(f"wrote {out / 'crosscheck.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
