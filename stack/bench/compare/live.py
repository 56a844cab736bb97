"""One live run of ``smetric compare``: a fresh emulated pool (``smetric up``), the router
under test in front of it (ours, or sglang-router), one replay of the trace; and what each
prefill worker counted."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from stack.bench.compare.peer_router import start_sglang_router, stop
from stack.bench.live import pool_replay_config
from stack.ports import free_port


def live_run(args: argparse.Namespace, router: str, policy: str, trace, show: bool, log_dir: Path) -> dict:
    """One live run: a fresh pool, the router (ours or sglang-router), one replay."""
    from stack.replay.localstack import local_stack
    from stack.replay.progress import replay_with_progress

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
        proc = None
        try:
            if ours:
                target, metrics_url = info["router_url"], None
            else:
                port = free_port()
                target, metrics_url = f"http://127.0.0.1:{port}", ""  # sglang-router's /metrics: none
            cfg, emu = pool_replay_config(args, info, target, args.request_timeout, metrics_url=metrics_url)
            if not ours:
                proc = start_sglang_router(info["run_dir"], policy, port, args.request_timeout, log_dir)
            label = f"{'ours' if ours else 'sglang-router'} {policy}"
            res = replay_with_progress(cfg, trace, label, show)
            res["prefill_workers"] = worker_counters(info["prefill"])
        finally:
            if proc is not None:
                stop(proc)
    res["router"] = "smetric router" if ours else "sglang-router"
    res["policy"] = policy
    res["capacity_tokens"] = emu.get("capacity_tokens")
    res["hardware"] = emu.get("hardware")
    res["lost"] = int(res.get("requests_sent") or 0) - int(res.get("requests_total") or 0)
    res["loadavg_before"] = [round(x, 2) for x in load0]
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start))
    return res


def worker_counters(urls: list[str]) -> list[dict]:
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
