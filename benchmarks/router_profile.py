"""Where the live router's CPU goes: `smetric router` sampled by py-spy under load.

Starts the fast fake workers (32 prefill, 1 decode) and our router with one policy, warms
it, then sends sequential non-streaming chat requests (the bodies of
``benchmarks/router_overhead.py``: a 4 KB first turn or a 400 KB follow-up) while py-spy
samples the router process. Each sample is charged to the innermost frame's library (the
HTTP server, the HTTP client, asyncio, the tokenizer, ...) or, for our code, to its module
(the dispatch queue, the cluster view, the PD forwarder, ...); the table gives each one's
share of the router's busy samples, beside the CPU per request measured from /proc.

    python benchmarks/router_profile.py [--policy round-robin] [--body 4k|400k] [--n 2000]

Needs py-spy (the dev extra) and permission to read the router's memory (ptrace: the same
user, or root). py-spy's view of a coroutine starts at the event loop's step, so these are
self-time shares by innermost frame, not inclusive times.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from router_overhead import free_ports, large_bodies, small_bodies, start_fake_workers, wait_http  # noqa: E402

#: innermost functions of ours that are thin loops around a call into a native extension,
#: which py-spy cannot see into: their samples are the extension's
NATIVE_CALLERS = {
    "Tokenizer._encode_missing": "HF tokenizer (native, with its calling loop)",
    "read_json": "JSON parse (orjson, native)",
}
#: (substring of a frame's file, bucket): the first that matches names the bucket
BUCKETS = (
    ("uvicorn", "uvicorn (HTTP server)"),
    ("httptools", "uvicorn (HTTP server)"),
    ("starlette", "starlette (request, response)"),
    ("aiohttp", "aiohttp (HTTP client)"),
    ("yarl", "aiohttp (HTTP client)"),
    ("multidict", "aiohttp (HTTP client)"),
    ("prometheus_client", "metrics (prometheus)"),
    ("stack/prefill_router/metrics", "metrics (prometheus)"),
    ("tokenizers", "HF tokenizer (native, with its calling loop)"),
    ("transformers", "HF tokenizer (native, with its calling loop)"),
    ("jinja2", "chat template (jinja2)"),
    ("<template>", "chat template (jinja2)"),
    ("stack/prefill_router/features", "ours: prompt features"),
    ("stack/prefill_router/offload", "ours: prompt features"),
    ("stack/kv_tier", "ours: prefix index, global tier"),
    ("stack/dispatch", "ours: dispatch order, readiness"),
    ("stack/prefill_router/queue", "ours: dispatch queue"),
    ("stack/prefill_router/view", "ours: cluster view"),
    ("stack/core/types", "ours: cluster view"),
    ("stack/core/cost_model", "ours: routing, policy"),
    ("<string>", "ours: cluster view"),  # the dataclasses' generated __init__ (InstanceState)
    ("stack/pool", "ours: pool, booking"),
    ("stack/prefill_router/routing", "ours: routing, policy"),
    ("stack/policies", "ours: routing, policy"),
    ("stack/decode_router", "ours: PD forwarder"),
    ("stack/prefill_router/api", "ours: handler (parse, answer)"),
    ("stack/", "ours: other"),
    ("asyncio", "asyncio (tasks, futures, loop)"),
)


def bucket(frame: str) -> str:
    func, _, where = frame.partition(" (")
    if func in NATIVE_CALLERS:
        return NATIVE_CALLERS[func]
    path = where.rsplit(":", 1)[0]
    for key, name in BUCKETS:
        if key in path:
            return name
    return "other"


def shares(raw: Path) -> tuple[collections.Counter, int]:
    """Busy samples per bucket from py-spy's raw (folded) output, and their total; samples
    whose innermost frame is the event loop's run (waiting in epoll) are idle."""
    out: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith("Runner.run") or frames[-1].startswith("run_forever"):
            continue
        out[bucket(frames[-1])] += int(cnt)
        total += int(cnt)
    return out, total


def cpu_ticks(pid: int) -> int:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # utime + stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="round-robin")
    ap.add_argument("--body", choices=["4k", "400k"], default="4k")
    ap.add_argument("--n", type=int, default=2000, help="measured requests")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")

    a = ap.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: pip install py-spy (the dev extra has it)")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="smetric-profile-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs: list[subprocess.Popen] = []

    def spawn(cmd: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd, stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        procs.append(p)
        return p

    try:
        from stack.models.tiny import build_tiny_model

        model = build_tiny_model(tmp / "model")
        ports = free_ports(34)
        pports, dport, rport = ports[:32], ports[32], ports[33]
        if not start_fake_workers(spawn, pports, dport):
            print(f"the fake workers did not start; see {tmp}")
            return 1
        cfg = {
            "model": {"name": "tiny", "path": str(model), "page_size": 64, "context_length": 1_000_000},
            "router": {"host": "127.0.0.1", "port": rport, "policy": a.policy, "log_level": "warning"},
            "prefill": [{"url": f"http://127.0.0.1:{p}", "bootstrap_port": 8998} for p in pports],
            "decode": [{"url": f"http://127.0.0.1:{dport}"}],
        }
        (tmp / "router.yaml").write_text(yaml.safe_dump(cfg))
        router = spawn(
            [sys.executable, "-m", "stack.cli", "router", "--config", str(tmp / "router.yaml")], "router.log"
        )
        if not wait_http(f"http://127.0.0.1:{rport}/health", 60, router):
            print(f"our router did not start: {(tmp / 'router.log').read_text()[-2000:]}")
            return 1
        warm = 20 if a.body == "4k" else 5
        bodies = (small_bodies if a.body == "4k" else large_bodies)(a.n + warm, seed=1)
        url = f"http://127.0.0.1:{rport}/v1/chat/completions"
        hdr = {"content-type": "application/json"}
        raw = tmp / "profile.txt"
        with httpx.Client(timeout=60.0) as c:
            for b in bodies[:warm]:
                c.post(url, content=b, headers=hdr)
            rec = subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    str(router.pid),
                    "-r",
                    str(a.rate),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # py-spy attaches
            t0 = cpu_ticks(router.pid)
            for b in bodies[warm:]:
                c.post(url, content=b, headers=hdr)
            ticks = cpu_ticks(router.pid) - t0
        rec.send_signal(2)
        rec.wait(30)
        if not raw.exists():
            print("py-spy wrote no profile (no permission to read the router's memory?)")
            return 1
        ms = ticks / os.sysconf("SC_CLK_TCK") * 1e3 / a.n
        by, total = shares(raw)
        print(f"smetric router, policy {a.policy}, {a.body} bodies, {a.n} sequential requests")
        print(f"CPU per request {ms:.3f} ms; {total} busy samples at {a.rate}/s")
        print("| share of busy samples | where (innermost frame) |")
        print("|---|---|")
        ours = 0
        for name, n in by.most_common():
            if name.startswith("ours"):
                ours += n
            print(f"| {100 * n / total:.1f}% | {name} |")
        print(f"ours in all: {100 * ours / total:.1f}%")
        return 0
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass


if __name__ == "__main__":
    raise SystemExit(main())
