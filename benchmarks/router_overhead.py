"""Router overhead: our router vs the real sglang-router (PD mode) on the same fake workers.

Starts fast fake SGLang workers (N prefill + 1 decode, one process), then for each target
(direct to the decode worker = baseline, our router, sglang-router) sends sequential
non-streaming chat requests and reports p50 / p99 latency and the latency added over the
baseline, for a ~4 KB first-turn body and a ~400 KB agent follow-up (a long cached
history plus a new turn: the router's tokenizer cache is warm, as in a live session).

    python benchmarks/router_overhead.py [--prefill 32] [--n-small 300] [--n-large 60]

sglang-router comes from PyPI (``pip install sglang-router``); if it is missing or fails to
start, its column says why. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


WORDS = "the quick brown fox jumps over lazy dog def main return import json print value tool call result error file path".split()


def blob(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def small_bodies(n: int) -> list[bytes]:
    import orjson

    rng = random.Random(1)
    return [
        orjson.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": blob(rng, 4000)}], "max_tokens": 1}
        )
        for _ in range(n)
    ]


def large_bodies(n: int, size: int = 400_000) -> list[bytes]:
    """One agent session: a ~size-byte history, each request a new follow-up turn on it."""
    import orjson

    rng = random.Random(2)
    hist = [{"role": "system", "content": "You are a coding agent. " * 20}]
    total = 0
    while total < size:
        u = blob(rng, 6000)
        a = blob(rng, 400)
        hist += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        total += len(u) + len(a)
    return [
        orjson.dumps(
            {
                "model": "tiny",
                "messages": hist + [{"role": "user", "content": blob(rng, 2000)}],
                "max_tokens": 1,
            }
        )
        for _ in range(n)
    ]


def measure(
    url: str, bodies: list[bytes], warmup: int = 5, pid: int | None = None
) -> tuple[list[float], float]:
    """Latencies of sequential requests, and the target process's CPU seconds per request."""
    lat = []
    with httpx.Client(timeout=60.0) as c:
        hdr = {"content-type": "application/json"}
        for b in bodies[:warmup]:
            c.post(url, content=b, headers=hdr)
        c0 = cpu_seconds(pid)
        for b in bodies:
            t0 = time.perf_counter()
            r = c.post(url, content=b, headers=hdr)
            lat.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
        cpu = (cpu_seconds(pid) - c0) / len(bodies)
    return lat, cpu


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (all its threads), from /proc; 0 when unavailable."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=32, help="prefill workers")
    ap.add_argument("--n-small", type=int, default=300)
    ap.add_argument("--n-large", type=int, default=60)
    ap.add_argument("--policy", default="smetric")
    ap.add_argument("--skip-sglang", action="store_true")
    a = ap.parse_args()

    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="smetric-bench-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def spawn(cmd, log):
        p = subprocess.Popen(
            cmd, stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        procs.append(p)
        return p

    try:
        sys.path.insert(0, str(ROOT))
        from stack.models.tiny import build_tiny_model

        model = build_tiny_model(tmp / "model")
        ports = free_ports(a.prefill + 3)
        pports, dport, our_port, sg_port = (
            ports[: a.prefill],
            ports[a.prefill],
            ports[a.prefill + 1],
            ports[a.prefill + 2],
        )
        fake = [sys.executable, "-m", "stack.worker.fake"]
        spawn(fake + ["--ports", ",".join(map(str, pports)), "--mode", "prefill"], "prefill.log")
        spawn(fake + ["--ports", str(dport), "--mode", "decode", "--tokens", "1"], "decode.log")
        for p in pports + [dport]:
            if not wait_http(f"http://127.0.0.1:{p}/health", 30):
                print(f"fake worker on {p} did not start; see {tmp}")
                return 1
        import yaml

        cfg = {
            "model": {"name": "tiny", "path": str(model), "page_size": 64, "context_length": 1_000_000},
            "router": {"host": "127.0.0.1", "port": our_port, "policy": a.policy, "log_level": "warning"},
            "prefill": [{"url": f"http://127.0.0.1:{p}", "bootstrap_port": 8998} for p in pports],
            "decode": [{"url": f"http://127.0.0.1:{dport}"}],
        }
        (tmp / "router.yaml").write_text(yaml.safe_dump(cfg))
        smetric = shutil.which("smetric")
        cmd = [smetric] if smetric else [sys.executable, "-m", "stack.cli"]
        ours = spawn(cmd + ["router", "--config", str(tmp / "router.yaml")], "ours.log")
        if not wait_http(f"http://127.0.0.1:{our_port}/health", 60, ours):
            print(f"our router did not start: {(tmp / 'ours.log').read_text()[-2000:]}")
            return 1

        sg_status = None
        if a.skip_sglang:
            sg_status = "skipped (--skip-sglang)"
        else:
            try:
                import sglang_router  # noqa: F401
            except ImportError:
                sg_status = "not installed (pip install sglang-router)"
        if sg_status is None:
            sg_cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
            for p in pports:
                sg_cmd += ["--prefill", f"http://127.0.0.1:{p}", "8998"]
            sg_cmd += ["--decode", f"http://127.0.0.1:{dport}", "--prefill-policy", "cache_aware"]
            sg_cmd += ["--host", "127.0.0.1", "--port", str(sg_port), "--log-level", "warn"]
            sg = spawn(sg_cmd, "sglang_router.log")
            if not wait_http(f"http://127.0.0.1:{sg_port}/health", 60, sg):
                sg_status = "failed to start: " + (tmp / "sglang_router.log").read_text()[-500:].replace(
                    "\n", " "
                )

        targets = {"direct (decode worker)": f"http://127.0.0.1:{dport}/v1/chat/completions"}
        targets["smetric router"] = f"http://127.0.0.1:{our_port}/v1/chat/completions"
        pids = {"direct (decode worker)": None, "smetric router": ours.pid}
        if sg_status is None:
            targets["sglang-router PD"] = f"http://127.0.0.1:{sg_port}/v1/chat/completions"
            pids["sglang-router PD"] = sg.pid

        small = small_bodies(a.n_small)
        large = large_bodies(a.n_large)
        print(f"prefill workers: {a.prefill}, decode: 1, policy: {a.policy}")
        print(
            f"bodies: small {len(small[0]) / 1024:.1f} KB x {len(small)}, large {len(large[0]) / 1024:.0f} KB x {len(large)}"
        )
        try:
            import orjson

            from stack.prefill_router.features import FeatureExtractor

            fx = FeatureExtractor(model, 64)
            print(
                f"large body: {fx.chat(orjson.loads(large[0])).prompt_tokens} tokens with the tiny test tokenizer"
            )
        except Exception as e:  # noqa: BLE001
            print(f"(token count unavailable: {e})")
        results = {}
        cpu = {}
        for name, url in targets.items():
            for kind, bodies in (("4KB", small), ("400KB", large)):
                try:
                    results[(name, kind)], cpu[(name, kind)] = measure(url, bodies, pid=pids[name])
                except Exception as e:  # noqa: BLE001
                    results[(name, kind)] = e
        base = {k: results[("direct (decode worker)", k)] for k in ("4KB", "400KB")}
        print()
        print(
            f"{'target':26s} {'body':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50':>10s} {'added p99':>10s} {'cpu/req ms':>10s}"
        )
        for name in targets:
            for kind in ("4KB", "400KB"):
                r = results[(name, kind)]
                if isinstance(r, Exception):
                    print(f"{name:26s} {kind:>6s}  error: {r}")
                    continue
                b = base[kind]
                p50, p99 = pct(r, 0.5) * 1e3, pct(r, 0.99) * 1e3
                c = cpu.get((name, kind), 0.0) * 1e3
                print(
                    f"{name:26s} {kind:>6s} {p50:8.2f} {p99:8.2f} {p50 - pct(b, 0.5) * 1e3:10.2f} "
                    f"{p99 - pct(b, 0.99) * 1e3:10.2f} {c:10.2f}"
                )
        if sg_status is not None:
            print(f"sglang-router: {sg_status}")
        print(
            f"(load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; cpu/req: router process CPU time per request)"
        )
        return 0
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
