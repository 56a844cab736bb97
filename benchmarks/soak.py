"""A bounded soak through the local stack: fixed request rate, the router's memory and error
counters sampled over time, and a verdict on whether either grows without bound.

    python benchmarks/soak.py --duration 300 --rate 8          # 5 minutes at 8 requests/s
    python benchmarks/soak.py --duration 300 --rate 8 --distinct 0   # every request new
    python benchmarks/soak.py --duration 30 --rate 5 --sample 5 --no-mooncake   # a quick look

It starts ``smetric up`` (mooncake_master, emulated prefill and decode workers, the router;
``stack.launch.api.local_stack``), sends requests open-loop at ``--rate`` (agent sessions whose
chat turns grow, completions and ``/generate``, half streamed; ``--distinct`` bodies cycled, so
once the first cycle has filled the router's caches any further growth is a leak, or with
``--distinct 0`` every prompt new, the caches filling towards their bounds), and every ``--sample`` seconds
records the router's RSS (``/proc/<pid>/status``), its ``/metrics`` error counters and the
client's own count of ok / clean error / lost requests. It prints one row per sample, then:

- RSS: the least-squares slope over the second half of the run (MB/min) and the growth over
  that half; the verdict is "bounded" when the second-half growth is under 5 % (or 2 MB);
- errors: 5xx answers and lost requests must not grow (the verdict wants none lost).

Exit status 0 when both verdicts hold. ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stack.faults import Counts, request_outcome  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def router_pid(run_dir: str) -> int:
    for f in (Path(run_dir) / "pids").glob("*.json"):
        rec = json.loads(f.read_text())
        if rec.get("role") == "router" or f.stem.startswith("router"):
            return int(rec["pid"])
    raise RuntimeError(f"no router pid file in {run_dir}/pids")


def scrape(text: str) -> dict:
    """Totals of the router's error counters from /metrics."""
    out = {"req_2xx": 0.0, "req_4xx": 0.0, "req_5xx": 0.0, "upstream_errors": 0.0, "retries": 0.0}
    out["ejections"] = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, val = line.rpartition(" ")
        try:
            v = float(val)
        except ValueError:
            continue
        if name.startswith("smetric_requests_total{"):
            st = name.split('status="', 1)[1][:1]
            key = {"2": "req_2xx", "4": "req_4xx", "5": "req_5xx"}.get(st)
            if key:
                out[key] += v
        elif name.startswith("smetric_upstream_errors_total"):
            out["upstream_errors"] += v
        elif name.startswith("smetric_retries_total"):
            out["retries"] += v
        elif name.startswith("smetric_ejections_total"):
            out["ejections"] += v
    return out


class Load:
    """Open-loop requests: agent sessions of growing chat turns, completions and ``/generate``.

    Request ``i`` is a pure function of ``i % distinct``: after ``distinct`` requests the same
    bodies come round again, so the router's caches stop filling and any further growth of its
    memory is a leak. ``distinct=0``: every request is new (the caches fill towards their bounds).
    """

    def __init__(self, max_tokens: int, distinct: int = 0) -> None:
        self.i = 0
        self.max_tokens = max_tokens
        self.distinct = distinct

    def next(self) -> tuple[str, dict]:
        i = self.i
        self.i += 1
        k = i % self.distinct if self.distinct else i
        stream = k % 2 == 1
        kind = k % 4
        mt = self.max_tokens
        if kind in (0, 1):  # a chat session of up to 12 turns, 24 requests wide
            sid, t = k // 24, (k % 24) // 4 * 2 + kind
            msgs = [{"role": "system", "content": f"agent {sid}. " * 40}]
            for j in range(t):
                msgs.append({"role": "user", "content": f"session {sid} step {j}: edit file_{j}.py. " * 10})
                msgs.append({"role": "assistant", "content": f"done step {j}"})
            msgs.append({"role": "user", "content": f"session {sid} step {t}: edit file_{t}.py. " * 10})
            return "/v1/chat/completions", {  # no model: the one served
                "messages": msgs,
                "max_tokens": mt,
                "stream": stream,
            }
        if kind == 2:
            prompt = f"one-off {k}: summarise the diff of commit {k * 7919}. " * 12
            return "/v1/completions", {"prompt": prompt, "max_tokens": mt, "stream": stream}
        ids = [(k * 131 + j * 17) % 30000 + 1 for j in range(300)]
        sp = {"max_new_tokens": mt, "ignore_eos": True}
        return "/generate", {"input_ids": ids, "sampling_params": sp, "stream": stream}


async def soak(
    url: str, pid: int, duration: float, rate: float, sample: float, max_tokens: int, distinct: int = 0
) -> list[dict]:
    counts = Counts()
    rows: list[dict] = []
    load = Load(max_tokens, distinct)
    inflight: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(70, connect=10), limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=10) as probe,
    ):

        async def one(path: str, body: dict) -> None:
            kind, reason = await request_outcome(client, path, body, 60.0)
            counts.add(kind, reason)

        def take_sample(t: float) -> None:
            m = scrape(probe_text[0])
            row = {
                "t_s": round(t, 1),
                "rss_mb": round(rss_mb(pid), 2),
                "sent": load.i,
                "done": counts.sent,
                "ok": counts.ok,
                "clean": counts.clean,
                "lost": counts.lost,
                "inflight": len(inflight),
                **{k: int(v) for k, v in m.items()},
                "load1": round(os.getloadavg()[0], 2),
            }
            rows.append(row)
            print(_fmt(row), flush=True)

        probe_text = [(await probe.get("/metrics")).text]
        print(_header(), flush=True)
        take_sample(0.0)
        t0 = time.monotonic()
        next_sample = sample
        k = 0
        while True:
            now = time.monotonic() - t0
            if now >= duration:
                break
            due = k / rate
            if due <= now:
                path, body = load.next()
                t = asyncio.create_task(one(path, body))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
                k += 1
                continue
            if now >= next_sample:
                probe_text[0] = (await probe.get("/metrics")).text
                take_sample(now)
                next_sample += sample
                continue
            await asyncio.sleep(min(due, next_sample) - now)
        if inflight:
            await asyncio.wait(inflight, timeout=70)
        probe_text[0] = (await probe.get("/metrics")).text
        take_sample(time.monotonic() - t0)
    return rows


_COLS = [
    "t_s",
    "rss_mb",
    "sent",
    "done",
    "ok",
    "clean",
    "lost",
    "inflight",
    "req_5xx",
    "upstream_errors",
    "retries",
    "load1",
]


def _header() -> str:
    return " ".join(f"{c:>9}" for c in _COLS)


def _fmt(row: dict) -> str:
    return " ".join(f"{row[c]:>9}" for c in _COLS)


def slope_per_min(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def verdict(rows: list[dict], duration: float) -> tuple[bool, list[str]]:
    half = [r for r in rows if r["t_s"] >= duration / 2]
    if len(half) < 2:
        half = rows[-2:]
    xs = [r["t_s"] for r in half]
    ys = [r["rss_mb"] for r in half]
    growth = ys[-1] - ys[0]
    slope = slope_per_min(xs, ys)
    rss_ok = growth < max(2.0, 0.05 * ys[0])
    last = rows[-1]
    err_ok = last["lost"] == 0 and last["req_5xx"] == 0
    lines = [
        f"router RSS: {rows[0]['rss_mb']:.1f} MB at start, {ys[0]:.1f} MB at half time, "
        f"{ys[-1]:.1f} MB at the end; second half slope {slope:+.2f} MB/min, growth {growth:+.1f} MB "
        f"-> {'bounded' if rss_ok else 'GROWING'}",
        f"requests: sent {last['sent']}, ok {last['ok']}, clean errors {last['clean']}, lost {last['lost']}; "
        f"router 5xx {last['req_5xx']}, upstream errors {last['upstream_errors']}, retries {last['retries']} "
        f"-> {'no errors' if err_ok else 'ERRORS'}",
    ]
    return rss_ok and err_ok, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (open loop)")
    ap.add_argument("--sample", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--distinct",
        type=int,
        default=600,
        help="distinct request bodies, cycled (0: every request new, the caches keep filling)",
    )
    ap.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    ap.add_argument("--url", help="soak a router that is already running (then --pid too)")
    ap.add_argument("--pid", type=int, help="the router's pid, with --url")
    ap.add_argument("--json", help="write every sample here")
    a = ap.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    def run(url: str, pid: int) -> list[dict]:
        return asyncio.run(soak(url, pid, a.duration, a.rate, a.sample, a.max_tokens, a.distinct))

    if a.url:
        if not a.pid:
            ap.error("--url needs --pid")
        rows = run(a.url, a.pid)
    else:
        from stack.launch.api import local_stack

        with local_stack(prefill=a.prefill, decode=a.decode, mooncake=not a.no_mooncake) as info:
            rows = run(info["router_url"], router_pid(info["run_dir"]))
    ok, lines = verdict(rows, a.duration)
    print()
    for line in lines:
        print(line)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "samples": rows, "verdict": lines}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
