"""How well the router's LMCache view predicts the hit a worker gets from LMCache.

    python benchmarks/lmcache_view_accuracy.py [--sessions 6] [--turns 6] [--workers 2] [--seed 1]

Real components on loopback: mooncake_master and lmcache_controller (started by the launcher's
own specs, stack.launch.lmcache_tier / sglang), and ``--workers`` real LMCache engines
(stack.kv_tier.lmcache_engine_sidecar, LMCache's environment) with the Mooncake store behind
them. Agentic sessions, served round robin: each turn's prompt is the last prompt plus that
turn's answer and a new message (300-1500 tokens), sent to a random worker (a migration when
it is not the last one's). For every turn:

1. predicted: the router's view (stack.kv_tier.lmcache_view.LMCacheLookup over the
   controller's POST /lookup) of the prompt's prefix LMCache holds, in tokens (page 64);
2. reported: the worker's engine retrieves the prompt (``retrieve``: local CPU, else the
   Mooncake store) and reports the tokens it got;
3. the worker stores the prompt's KV (the turn's prefill).

Prints: turns, migrated turns, mean |predicted - reported| in tokens, the share within one
256-token chunk, the share exact, the share where the view over-predicts (a hit the worker
does not get), and the view's lookup latency p50/p99. A turn with nothing to hit (the first of
each session) counts too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.kv_tier.lmcache_client import SIDECAR_ENV, LMCacheClient, lmcache_python, sidecar_argv  # noqa: E402
from stack.kv_tier.lmcache_view import LMCacheLookup, http_lookup  # noqa: E402
from stack.launch.process import RunDir, probe, start, stop_groups  # noqa: E402
from stack.launch.sglang import sglang_process_specs  # noqa: E402

PAGE = 64
CHUNK = 256
BPT = 16


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    out = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return out


def _deployment(py: str, run_dir: Path) -> dict:
    ctl, pull, reply, rpc, meta, met, srv, http, w = _ports(9)
    bindir = Path(py).parent
    return {
        "model": {"name": "bench", "path": str(run_dir / "model"), "page_size": PAGE},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "run_dir": str(run_dir),
            "kv_tier": "lmcache",
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {"count": 1, "port": w, "disaggregation": False, "kv_events_port": None},
            "decode": {"count": 0},
            "lmcache": {
                "command": str(bindir / "lmcache"),
                "controller_command": str(bindir / "lmcache_controller"),
                "server": {"port": srv, "http_port": http, "l2": "none"},
                "controller": {"port": ctl, "pull_port": pull, "reply_port": reply},
            },
            "mooncake_master": {"rpc_port": rpc, "http_metadata_port": meta, "metrics_port": met},
            "router": {"enabled": False},
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="wait this long after the engines start (controller registration)",
    )
    ap.add_argument(
        "--timeout-s", type=float, default=1.0, help="the view's lookup budget (the router's default: 0.02)"
    )
    ap.add_argument("--verbose", action="store_true", help="print every turn off by more than a chunk")
    args = ap.parse_args()
    py = lmcache_python()
    if py is None:
        print("LMCache's environment is missing: bash .ci/install-lmcache.sh", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="lmcache-acc-"))
    cfg = _deployment(py, tmp / "run")
    specs = [s for s in sglang_process_specs(cfg) if s.role in ("mooncake_master", "lmcache_controller")]
    run = RunDir(cfg["launch"]["run_dir"])
    started = []
    procs: list[subprocess.Popen] = []
    try:
        for i, s in enumerate(specs):
            started.append(start(s, run, i))
        deadline = time.monotonic() + 60
        while not all(probe(s, timeout=1) for s in specs):
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master / lmcache_controller not ready")
            time.sleep(0.2)
        c = cfg["launch"]["lmcache"]["controller"]
        m = cfg["launch"]["mooncake_master"]
        ctl = (f"127.0.0.1:{c['pull_port']}", f"127.0.0.1:{c['reply_port']}")
        env = {**os.environ, **SIDECAR_ENV, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        workers = []
        for i in range(args.workers):
            port, wport, mport = _ports(3)
            argv = sidecar_argv(
                py,
                f"prefill-{i}",
                port,
                controller=ctl,
                worker_port=wport,
                mooncake_master=f"127.0.0.1:{m['rpc_port']}",
                mooncake_port=mport,
            )
            log = open(tmp / f"sidecar-{i}.log", "wb")
            procs.append(
                subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )
            workers.append(LMCacheClient(f"http://127.0.0.1:{port}", timeout_s=60))
        for w, p in zip(workers, procs, strict=True):
            deadline = time.monotonic() + 120
            while not w.healthy():
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sidecar {w.url} did not start (logs in {tmp})")
                time.sleep(0.3)
        time.sleep(args.warmup_s)
        view = LMCacheLookup(
            http_lookup(f"http://127.0.0.1:{c['port']}"),
            block_size=PAGE,
            chunk_size=CHUNK,
            timeout_s=args.timeout_s,
        )
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(1, 30000) for _ in range(rng.randrange(800, 3000))] for _ in range(args.sessions)
        ]
        last = [-1] * args.sessions
        errs, lat, over, migrated = [], [], 0, 0
        loop = asyncio.new_event_loop()
        for _turn in range(args.turns):
            for s in range(args.sessions):
                prompt = prompts[s]
                wi = rng.randrange(args.workers)
                migrated += last[s] >= 0 and wi != last[s]
                t0 = time.perf_counter()
                blocks = loop.run_until_complete(view.hit_blocks(list(range(len(prompt) // PAGE)), prompt))
                lat.append(time.perf_counter() - t0)
                predicted = blocks * PAGE
                reported = workers[wi].retrieve(prompt).hit_tokens
                errs.append(abs(predicted - reported))
                if args.verbose and errs[-1] > CHUNK:
                    print(
                        f"  session {s} turn {_turn} worker {wi} (last {last[s]}): prompt {len(prompt)}, "
                        f"predicted {predicted}, reported {reported}"
                    )
                over += predicted > reported
                workers[wi].store(prompt, rng.randbytes(len(prompt) * BPT))
                last[s] = wi
                prompts[s] = prompt + [rng.randrange(1, 30000) for _ in range(rng.randrange(300, 1500))]
        loop.close()
        n = len(errs)
        lat_ms = sorted(x * 1000 for x in lat)
        print(
            f"turns {n}, migrated {migrated}, workers {args.workers}, sessions {args.sessions}, seed {args.seed}"
        )
        print(f"mean |predicted - reported|: {statistics.mean(errs):.1f} tokens")
        print(f"within one chunk ({CHUNK} tokens): {sum(e <= CHUNK for e in errs) / n:.1%}")
        print(f"exact: {sum(e == 0 for e in errs) / n:.1%}; over-predicted: {over / n:.1%}")
        print(
            f"view lookup latency: p50 {lat_ms[n // 2]:.2f} ms, p99 {lat_ms[min(n - 1, int(n * 0.99))]:.2f} ms; "
            f"view errors {view.errors}, timeouts {view.timeouts} (budget {args.timeout_s * 1000:.0f} ms; a timed-out "
            "lookup answers from the router's own index, here empty: 0)"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        stop_groups([m.to_json() for m in started], run, grace_s=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
