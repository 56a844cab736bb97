"""Router replicas on Redis: the same replay through 1, 2 and 4 router replicas.

One emulated PD pool (``smetric up`` without its router: N emulated prefill workers with KV
events, M decode workers) and one redis-server stay up; for each replica count the script
starts that many ``smetric router`` processes on the pool (one router: no Redis, today's
single router; several: ``router.redis_url`` set, one namespace per run), flushes the
workers' prefix caches, and replays the same trace with the same seeded load. The client
spreads the requests over the replicas (``--spread session``: by a hash of the session, as a
load balancer with affinity would; ``request``: round-robin per request, so consecutive
turns of one session land on different replicas).

Load imbalance is the simulator's and ``smetric replay``'s: per window of 30 modelled
seconds, max / mean over prefill workers of the time-averaged requests in flight, summed
over all replicas' ``/metrics``; ``imb_mean`` is its mean over the measured windows.

    python benchmarks/replicas.py [--replicas 1,2,4] [--prefill 4] [--session-rate 0.06] [--duration 600]

Needs redis-server on PATH (``bash .ci/install-system.sh``). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import zlib
from itertools import count
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack.launch.redis_server import RedisServer  # noqa: E402
from stack.ports import free_port  # noqa: E402
from stack.replay.metrics import LoadSampler, decisions, parse_prometheus, prefill_inflight  # noqa: E402


class Spread(httpx.AsyncHTTPTransport):
    """Sends each request to one of the replicas: by session hash or round-robin."""

    def __init__(self, ports: list[int], mode: str, **kw) -> None:
        super().__init__(**kw)
        self.ports = ports
        self.mode = mode
        self._rr = count()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        tok = request.headers.get("x-session-token")
        if self.mode == "session" and tok:
            i = zlib.crc32(tok.encode()) % len(self.ports)
        else:
            i = next(self._rr) % len(self.ports)
        port = self.ports[i]
        request.url = request.url.copy_with(port=port)
        request.headers["host"] = f"127.0.0.1:{port}"
        return await super().handle_async_request(request)


def start_routers(base_cfg: dict, n: int, redis_url: str | None, ns: str, logs: Path) -> list:
    procs = []
    for i in range(n):
        cfg = json.loads(json.dumps(base_cfg))
        rc = cfg.setdefault("router", {})
        port = free_port()
        rc.update({"port": port, "host": "127.0.0.1", "log_level": "warning"})
        if redis_url:
            rc.update({"redis_url": redis_url, "redis_namespace": ns, "replica_id": f"r{i}"})
        path = logs / f"router-{ns}-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log = open(logs / f"router-{ns}-{i}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "router", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        procs.append((p, port, log))
    deadline = time.monotonic() + 60
    for p, port, _ in procs:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"router exited ({p.returncode}); see {logs}")
            try:
                h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                if h.get("status") == "ok" and (not redis_url or h.get("shared_state") == "up"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("routers not ready")
            time.sleep(0.1)
    return procs


def stop_routers(procs) -> None:
    for p, _, _ in procs:
        p.terminate()
    for p, _, log in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


def flush_caches(urls: list[str]) -> None:
    for u in urls:
        for _ in range(50):
            if httpx.post(u + "/flush_cache", timeout=10).status_code == 200:
                break
            time.sleep(0.2)


async def scrape_all(client: httpx.AsyncClient, ports: list[int]):
    async def one(port):
        try:
            r = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            return parse_prometheus(r.text) if r.status_code == 200 else []
        except httpx.HTTPError:
            return []

    return await asyncio.gather(*(one(p) for p in ports))


def _total(samples, name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


async def run_one(args, rcfg, ports: list[int], tf: float, tokenizer: str | None) -> dict:
    from stack.bench.live import session_load
    from stack.replay.driver import Replay, ReplayConfig

    load = session_load(args)
    limits = httpx.Limits(max_connections=260, max_keepalive_connections=260)
    cfg = ReplayConfig(
        target=f"http://127.0.0.1:{ports[0]}",
        trace=args.trace,
        load=load,
        time_factor=tf,
        request_timeout=args.request_timeout,
        tokenizer=tokenizer,
        metrics_url="",  # sampled here, over all replicas
        transport=Spread(ports, args.spread, limits=limits),
    )
    rp = Replay(cfg)
    sampler = LoadSampler(cfg.window_s)
    async with httpx.AsyncClient() as mc:
        before = await scrape_all(mc, ports)
        task = asyncio.create_task(rp.run())
        while not hasattr(rp, "t0") and not task.done():
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        while not task.done():
            per = await scrape_all(mc, ports)
            total: dict[str, float] = {}
            for samples in per:
                for k, v in prefill_inflight(samples).items():
                    total[k] = total.get(k, 0.0) + v
            if total:
                sampler.add((loop.time() - rp.t0) / tf, total)
            await asyncio.sleep(0.25)
        res = await task
        after = await scrape_all(mc, ports)
    imb = sampler.imbalance(res["warmup_s"], res["warmup_s"] + res["duration_s"])
    dec: dict[str, float] = {}
    conflicts = 0.0
    rsum = rcount = 0.0
    for b, a in zip(before, after, strict=True):
        rsum += _total(a, "smetric_routing_seconds_sum") - _total(b, "smetric_routing_seconds_sum")
        rcount += _total(a, "smetric_routing_seconds_count") - _total(b, "smetric_routing_seconds_count")
        db, da = decisions(b), decisions(a)
        for k in da:
            dec[k] = dec.get(k, 0.0) + da[k] - db.get(k, 0.0)
        conflicts += sum(v for n, _, v in a if n == "smetric_shared_claim_conflicts_total")
        conflicts -= sum(v for n, _, v in b if n == "smetric_shared_claim_conflicts_total")
    res["imb_mean"] = sum(imb) / len(imb) if imb else float("nan")
    res["imb_max"] = max(imb) if imb else float("nan")
    res["windows"] = len(imb)
    res["decisions_all"] = dec
    res["claim_conflicts"] = conflicts
    res["routing_ms"] = 1000 * rsum / rcount if rcount else float("nan")
    return res


def main(argv=None) -> int:
    from stack.paths import default_trace
    from stack.replay.localstack import local_stack

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--replicas", default="1,2,4", help="replica counts to run (1 = a single router, no Redis)"
    )
    ap.add_argument("--redis-single", action="store_true", help="run 1 replica on Redis too (its overhead)")
    ap.add_argument("--spread", choices=["session", "request"], default="session")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--trace", default=str(default_trace()))
    ap.add_argument("--time-factor", type=float, default=0.1)
    ap.add_argument("--session-rate", type=float, default=0.06)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=100.0)
    ap.add_argument("--max-think", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--policy", default="smetric")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole set this many times")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.replicas.split(",")]

    import tempfile

    run_dir = Path(tempfile.mkdtemp(prefix="smetric-replicas-"))
    rows = []
    with (
        RedisServer(run_dir) as rs,
        local_stack(
            prefill=args.prefill,
            decode=args.decode,
            policy=args.policy,
            ports="auto",
            time_factor=args.time_factor,
            mooncake=False,
            router=False,
            run_dir=run_dir / "stack",
        ) as info,
    ):
        state = json.loads((run_dir / "stack" / "state.json").read_text())
        base_cfg = yaml.safe_load(Path(state["router_config"]).read_text())
        si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
        tf = float((si.get("emulator") or {}).get("time_factor") or args.time_factor)
        tok = si.get("tokenizer_path")
        tok = tok if tok and Path(tok).is_dir() else None
        plan = [(n, n > 1) for n in counts]
        if args.redis_single:
            plan.insert(counts.index(1) + 1 if 1 in counts else 0, (1, True))
        for n, use_redis in plan * args.repeat:
            flush_caches(info["prefill"])
            ns = f"bench-{n}-{int(use_redis)}"
            procs = start_routers(base_cfg, n, rs.url if use_redis else None, ns, run_dir)
            try:
                load0 = os.getloadavg()[0]
                t0 = time.monotonic()
                res = asyncio.run(run_one(args, base_cfg, [p for _, p, _ in procs], tf, tok))
                res["wall"] = time.monotonic() - t0
                res["load_before"] = load0
                res["load_after"] = os.getloadavg()[0]
            finally:
                stop_routers(procs)
            res["replicas"] = n
            res["redis"] = use_redis
            rows.append(res)
            print(
                f"# {n} replica(s){' on Redis' if use_redis else ''}: {res['requests']} requests, "
                f"{res.get('errors', 0)} errors, {res['wall']:.0f} s wall, load {res['load_before']:.1f}"
                f"->{res['load_after']:.1f}",
                file=sys.stderr,
                flush=True,
            )
    singles = [r for r in rows if r["replicas"] == 1 and not r["redis"]] or rows[:1]
    base = {  # "vs 1": against the mean of the single-router runs
        k: sum(r[k] for r in singles) / len(singles) for k in ("imb_mean", "prefill_tps_within_slo")
    }
    hdr = (
        f"{'replicas':>8} {'redis':>5} {'requests':>8} {'errors':>6} {'imb_mean':>8} {'vs 1':>6} "
        f"{'imb_max':>7} {'tps_in_slo':>10} {'vs 1':>6} {'slo_att':>7} {'ttft_p50':>8} {'ttft_p90':>8} "
        f"{'sticks':>6} {'migr':>5} {'conflicts':>9} {'route_ms':>8}"
    )
    print(
        f"# {Path(args.trace).name}, {args.prefill} prefill + {args.decode} decode emulated workers, "
        f"{args.session_rate} sessions/s for {args.duration:.0f} s (modelled), time factor {args.time_factor}, "
        f"spread by {args.spread}, policy {args.policy}"
    )
    print(hdr)
    for r in rows:
        d = r["decisions_all"]
        print(
            f"{r['replicas']:>8} {'yes' if r['redis'] else 'no':>5} {r['requests']:>8} {r.get('errors', 0):>6} "
            f"{r['imb_mean']:>8.3f} {r['imb_mean'] / base['imb_mean'] - 1:>+6.1%} {r['imb_max']:>7.2f} "
            f"{r['prefill_tps_within_slo']:>10.0f} "
            f"{r['prefill_tps_within_slo'] / max(base['prefill_tps_within_slo'], 1e-9) - 1:>+6.1%} "
            f"{r['slo_attainment']:>7.3f} {r['ttft_p50']:>8.3f} {r['ttft_p90']:>8.3f} "
            f"{d.get('stick', 0):>6.0f} {d.get('migrate', 0):>5.0f} {r['claim_conflicts']:>9.0f} "
            f"{r['routing_ms']:>8.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
