"""Router overhead: our router vs the Rust routers (sglang-router, smg; PD mode) on the same
fake workers, side by side in one run.

Starts fast fake SGLang workers (N prefill + 1 decode, one process), then for each target
(direct to the decode worker = baseline, our router once per ``--policies`` entry,
sglang-router, smg) sends sequential
non-streaming chat requests and reports p50 / p99 latency and the latency added over the
baseline, for a ~4 KB first-turn body and a ~400 KB agent follow-up (a long cached
history plus a new turn: the router's tokenizer cache is warm, as in a live session).

    python benchmarks/router_overhead.py [--prefill 32] [--n-small 300] [--n-large 60] [--rounds 2]

``--variant LABEL=JSON`` adds, per policy, a router whose ``router`` section has JSON merged in
(e.g. ``--variant 'tracing={"tracing": {"enabled": true}}'``: spans made, not exported), so a
feature's cost per request reads as the difference to the plain router's row.

The targets are measured in turn, ``--rounds`` times over (interleaved, so a load change
on a shared machine hits them alike); latencies pool over the rounds, CPU per request is
given as the min-max over rounds. sglang-router and smg come from PyPI (the project's dev
extra); if one is missing or fails to start, a line says why. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack.ports import free_port  # noqa: E402


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


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


def start_fake_workers(spawn, pports: list[int], dport: int) -> bool:
    """The fast fake workers (``stack.worker.fake``): prefill on ``pports`` in one process, the
    decode worker on ``dport`` in another; True once all answer /health. ``spawn(cmd, log)``
    starts a process."""
    fake = [sys.executable, "-m", "stack.worker.fake"]
    spawn(fake + ["--ports", ",".join(map(str, pports)), "--mode", "prefill"], "prefill.log")
    spawn(fake + ["--ports", str(dport), "--mode", "decode", "--tokens", "1"], "decode.log")
    return all(wait_http(f"http://127.0.0.1:{p}/health", 30) for p in pports + [dport])


WORDS = "the quick brown fox jumps over lazy dog def main return import json print value tool call result error file path".split()


def blob(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def small_bodies(n: int, seed: int = 0) -> list[bytes]:
    import orjson

    rng = random.Random(1 + 1000 * seed)
    return [
        orjson.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": blob(rng, 4000)}], "max_tokens": 1}
        )
        for _ in range(n)
    ]


def large_bodies(n: int, size: int = 400_000, seed: int = 0) -> list[bytes]:
    """One agent session: a ~size-byte history, each request a new follow-up turn on it."""
    import orjson

    rng = random.Random(2)  # the same history in every round
    hist = [{"role": "system", "content": "You are a coding agent. " * 20}]
    total = 0
    while total < size:
        u = blob(rng, 6000)
        a = blob(rng, 400)
        hist += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        total += len(u) + len(a)
    if seed:  # new follow-up turns in every round (a repeated one would be cached whole)
        rng = random.Random(10_000 + seed)
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
    url: str, bodies: list[bytes], warmup: int = 5, pid: int | None = None, headers: dict | None = None
) -> tuple[list[float], float]:
    """Latencies of sequential requests, and the target process's CPU seconds per request
    (the first ``warmup`` bodies are sent first and not measured; ``headers``: sent too, e.g.
    the API key of an ``--auth`` router)."""
    lat = []
    with httpx.Client(timeout=60.0) as c:
        hdr = {"content-type": "application/json", **(headers or {})}
        for b in bodies[:warmup]:
            c.post(url, content=b, headers=hdr)
        bodies = bodies[warmup:]
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
    ap.add_argument(
        "--policies",
        default="smetric,round-robin",
        help="our router's policies, one router process each (round-robin: the same work as a "
        "router that reads no prompt features; smetric: the full path)",
    )
    ap.add_argument("--policy", help="(old spelling) one policy of ours: same as --policies POLICY")
    ap.add_argument("--rust-policy", default="cache_aware", help="--prefill-policy of the Rust routers")
    ap.add_argument("--rounds", type=int, default=2, help="passes over all targets (interleaved)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="another router per policy, with JSON merged into its router section, e.g. "
        '\'tracing={"tracing": {"enabled": true}}\' (repeatable)',
    )
    ap.add_argument(
        "--auth",
        action="store_true",
        help="also run each policy with router.auth on (a key file of 100 keys with request-rate, "
        "token-rate and concurrency limits that never refuse here; requests carry the last key)",
    )
    ap.add_argument("--skip-sglang", action="store_true", help="no sglang-router")
    ap.add_argument("--skip-smg", action="store_true", help="no smg")
    ap.add_argument(
        "--skip-floor",
        action="store_true",
        help="no Python floor (benchmarks/python_floor_router.py: uvicorn + aiohttp alone)",
    )
    a = ap.parse_args()
    policies = [a.policy] if a.policy else [p for p in a.policies.split(",") if p]
    variants = [("", {})] + [parse_variant(v) for v in a.variant]
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="smetric-bench-"))
    if a.auth:
        import yaml as _yaml

        (tmp / "keys.yaml").write_text(_yaml.safe_dump(bench_keys()))
        variants.append(("auth", {"auth": {"keys_file": str(tmp / "keys.yaml")}}))
    routers = [(pol, label, extra) for pol in policies for label, extra in variants]
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
        ports = free_ports(a.prefill + 1 + len(routers) + 5)
        pports, dport = ports[: a.prefill], ports[a.prefill]
        our_ports = ports[a.prefill + 1 : a.prefill + 1 + len(routers)]
        sg_port, smg_port, sg_prom, smg_prom, floor_port = ports[-5:]
        if not start_fake_workers(spawn, pports, dport):
            print(f"the fake workers did not start; see {tmp}")
            return 1
        import yaml

        targets = {"direct (decode worker)": f"http://127.0.0.1:{dport}/v1/chat/completions"}
        pids: dict[str, int | None] = {"direct (decode worker)": None}
        headers: dict[str, dict] = {}  # per target: the API key of an --auth router
        smetric = shutil.which("smetric")
        cmd = [smetric] if smetric else [sys.executable, "-m", "stack.cli"]
        for (pol, label, extra), port in zip(routers, our_ports, strict=True):
            rc = {"host": "127.0.0.1", "port": port, "policy": pol, "log_level": "warning"}
            cfg = {
                "model": {"name": "tiny", "path": str(model), "page_size": 64, "context_length": 1_000_000},
                "router": merged(rc, extra),
                "prefill": [{"url": f"http://127.0.0.1:{p}", "bootstrap_port": 8998} for p in pports],
                "decode": [{"url": f"http://127.0.0.1:{dport}"}],
            }
            tag = f"{pol}-{label}" if label else pol
            (tmp / f"router-{tag}.yaml").write_text(yaml.safe_dump(cfg))
            ours = spawn(cmd + ["router", "--config", str(tmp / f"router-{tag}.yaml")], f"ours-{tag}.log")
            if not wait_http(f"http://127.0.0.1:{port}/health", 60, ours):
                print(f"our router did not start: {(tmp / f'ours-{tag}.log').read_text()[-2000:]}")
                return 1
            name = f"smetric router ({pol}, {label})" if label else f"smetric router ({pol})"
            targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            pids[name] = ours.pid
            if "auth" in extra:
                headers[name] = {"Authorization": f"Bearer {BENCH_KEY}"}

        notes = []
        if not a.skip_floor:
            fl = [
                sys.executable,
                str(ROOT / "benchmarks" / "python_floor_router.py"),
                "--port",
                str(floor_port),
            ]
            for p in pports:
                fl += ["--prefill", f"http://127.0.0.1:{p}"]
            floor = spawn(fl + ["--decode", f"http://127.0.0.1:{dport}"], "floor.log")
            if wait_http(f"http://127.0.0.1:{floor_port}/health", 60, floor):
                targets[FLOOR] = f"http://127.0.0.1:{floor_port}/v1/chat/completions"
                pids[FLOOR] = floor.pid
            else:
                notes.append(f"{FLOOR}: failed to start: {(tmp / 'floor.log').read_text()[-500:]}")

        def rust(name: str, module: str, launch: list[str], port: int, prom: int, skip: bool) -> None:
            if skip:
                notes.append(f"{name}: skipped")
                return
            try:
                __import__(module)
            except ImportError:
                notes.append(f"{name}: not installed (pip install -e '.[dev]')")
                return
            rc = [sys.executable, "-m", *launch, "--pd-disaggregation"]
            for p in pports:
                rc += ["--prefill", f"http://127.0.0.1:{p}", "8998"]
            rc += ["--decode", f"http://127.0.0.1:{dport}", "--prefill-policy", a.rust_policy]
            rc += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
            rc += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
            proc = spawn(rc, f"{module}.log")
            if not wait_http(f"http://127.0.0.1:{port}/health", 60, proc):
                log = (tmp / f"{module}.log").read_text()[-500:].replace("\n", " ")
                notes.append(f"{name}: failed to start: {log}")
                return
            targets[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
            pids[name] = proc.pid

        rust(
            f"sglang-router {_version('sglang-router')} PD",
            "sglang_router",
            ["sglang_router.launch_router"],
            sg_port,
            sg_prom,
            a.skip_sglang,
        )
        rust(f"smg {_version('smg')} PD", "smg", ["smg", "launch"], smg_port, smg_prom, a.skip_smg)

        # fresh bodies every round: each first turn is new to the router and each follow-up
        # turn is new on a cached history, as in a live session (5 more for the warm-up)
        small_r = [small_bodies(a.n_small + 5, seed=r) for r in range(a.rounds)]
        large_r = [large_bodies(a.n_large + 5, seed=r) for r in range(a.rounds)]
        small, large = small_r[0][5:], large_r[0][5:]
        print(
            f"prefill workers: {a.prefill}, decode: 1, our policies: {', '.join(policies)}, Rust routers' prefill policy: {a.rust_policy}"
        )
        print(
            f"bodies: small {len(small[0]) / 1024:.1f} KB x {len(small)}, large {len(large[0]) / 1024:.0f} KB x {len(large)}, {a.rounds} rounds"
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
        results: dict = {}
        cpu: dict = {}
        loads = []
        for rnd in range(a.rounds):
            for name, url in targets.items():
                for kind, bodies in (("4KB", small_r[rnd]), ("400KB", large_r[rnd])):
                    try:
                        lat, c = measure(url, bodies, pid=pids[name], headers=headers.get(name))
                    except Exception as e:  # noqa: BLE001
                        results[(name, kind)] = e
                        continue
                    if not isinstance(results.get((name, kind)), Exception):
                        results.setdefault((name, kind), []).extend(lat)
                        cpu.setdefault((name, kind), []).append(c)
            loads.append(os.getloadavg()[0])
        base = {k: results[("direct (decode worker)", k)] for k in ("4KB", "400KB")}
        print()
        print(
            f"{'target':34s} {'body':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50':>10s} {'added p99':>10s} {'cpu/req ms: median (min-max)':>30s}"
        )
        for name in targets:
            for kind in ("4KB", "400KB"):
                r = results.get((name, kind))
                if isinstance(r, Exception) or r is None:
                    print(f"{name:34s} {kind:>6s}  error: {r}")
                    continue
                b = base[kind]
                p50, p99 = pct(r, 0.5) * 1e3, pct(r, 0.99) * 1e3
                cs = cpu.get((name, kind), [0.0])
                rng_ = "-".join(dict.fromkeys(f"{x * 1e3:.2f}" for x in (min(cs), max(cs))))
                c = f"{statistics.median(cs) * 1e3:.2f} ({rng_})"
                print(
                    f"{name:34s} {kind:>6s} {p50:8.2f} {p99:8.2f} {p50 - pct(b, 0.5) * 1e3:10.2f} "
                    f"{p99 - pct(b, 0.99) * 1e3:10.2f} {c:>30s}"
                )
        for n in notes:
            print(n)
        for line in ratios(results, cpu, base, policies):
            print(line)
        print(
            f"(load average during the rounds: {', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} CPUs; "
            "cpu/req: the router process's CPU time per request, all threads, median and min-max over rounds)"
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


FLOOR = "python floor (uvicorn+aiohttp)"


#: the key the ``--auth`` runs send (the last of bench_keys' 100)
BENCH_KEY = "sk-bench-key-0099"


def bench_keys() -> dict:
    """``--auth``'s keys file: 100 keys, each with every limit, none of which refuses here."""
    lim = {"requests_per_s": 1e6, "prompt_tokens_per_s": 1e9, "max_concurrency": 1000}
    return {"keys": [{"name": f"bench-{i}", "key": f"sk-bench-key-{i:04d}", **lim} for i in range(100)]}


def parse_variant(v: str) -> tuple[str, dict]:
    """``LABEL=JSON`` of ``--variant``."""
    import json

    label, sep, text = v.partition("=")
    try:
        extra = json.loads(text) if sep else None
    except ValueError as e:
        raise SystemExit(f"--variant {v!r}: not JSON after '=' ({e})") from None
    if not label or not isinstance(extra, dict):
        raise SystemExit(
            f'--variant {v!r}: expected LABEL=JSON object, e.g. \'tracing={{"tracing": {{"enabled": true}}}}\''
        )
    return label, extra


def merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, nested mappings merged key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ratios(results: dict, cpu: dict, base: dict, policies: list[str]) -> list[str]:
    """Ours against the better Rust router (the lower figure of the two), per body: added
    p50, added p99 and CPU per request (the max over rounds for ours, the min for theirs:
    the conservative side); and the Python floor against the same."""
    rust = [n for n, _ in results if n.startswith(("sglang-router", "smg"))]
    rust = list(dict.fromkeys(rust))
    rows = [f"smetric router ({p})" for p in policies] + [FLOOR]
    out = []

    def fig(name: str, kind: str) -> tuple[float, float, float, float] | None:
        r = results.get((name, kind))
        if not isinstance(r, list) or not r:
            return None
        b = base[kind]
        cs = cpu.get((name, kind), [0.0])
        return (pct(r, 0.5) - pct(b, 0.5), pct(r, 0.99) - pct(b, 0.99), min(cs), max(cs))

    for kind in ("4KB", "400KB"):
        theirs = [f for f in (fig(n, kind) for n in rust) if f is not None]
        if not theirs:
            continue
        best_p50 = min(f[0] for f in theirs)
        best_p99 = min(f[1] for f in theirs)
        best_cpu = min(f[2] for f in theirs)
        for name in rows:
            f = fig(name, kind)
            if f is None:
                continue

            def x(a: float, b: float) -> str:
                return f"x{a / b:.2f}" if b > 0 else "n/a"

            out.append(
                f"{kind:>5s} {name} / better Rust router: added p50 {x(f[0], best_p50)}, "
                f"added p99 {x(f[1], best_p99)}, CPU per request {x(f[3], best_cpu)}"
            )
    return out


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
