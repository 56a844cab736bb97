"""The main job's live side (`smetric demo-live`): one policy's run over the real HTTP path.

:func:`live_one` brings up the local PD stack (``smetric up``: mooncake_master, emulated
prefill and decode workers sharing a few processes, the router with the run's dispatch queue),
replays the trace through the router with ``smetric replay``'s load model and stops everything
again; :func:`clock_stats` reads how often the emulators fell behind their modelled clocks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from stack.bench.live import pool_replay_config
from stack.bench.main_job import dispatch_of


def request_timeout(args: argparse.Namespace) -> float:
    """Wall seconds per request, also the PD twins' bootstrap wait: 3000 modelled seconds
    unless ``--request-timeout`` (only a stuck request times out: the simulator has none)."""
    return float(args.request_timeout or max(30.0, 3000.0 * args.time_factor))


def stack_config(args: argparse.Namespace, dispatch: dict | None = None) -> str:
    """The deployment YAML for `smetric up`: ``--config`` (or configs/local.yaml) with the PD
    twins' bootstrap wait raised to the request timeout (its 30 s would abort the prefill of a
    long prompt queued at the knee: an error the simulator cannot have), the run's queue, and
    with ``--shared-nic`` one modelled NIC for the workers (a link file) and the router's
    links per host."""
    import yaml

    from stack.launch.cli import default_config

    src = Path(args.config) if args.config else default_config()
    cfg = yaml.safe_load(src.read_text()) or {}
    launch = cfg.setdefault("launch", {})
    emu = launch.setdefault("emulator", {})
    emu["bootstrap_timeout_s"] = max(float(emu.get("bootstrap_timeout_s") or 0), request_timeout(args))
    if dispatch is not None:  # the run's dispatch queue, as the simulator beside it runs it
        cfg.setdefault("router", {})["dispatch"] = dispatch
    if getattr(args, "shared_nic", False):
        # one NIC for the prefill workers: the emulated fetches queue on one FIFO (a file) and
        # the router books them on one link per host, as the simulator's --link shared
        fd, nic = tempfile.mkstemp(prefix="demo-live-nic-")
        os.close(fd)
        emu["link_file"] = nic
        cfg.setdefault("router", {})["link"] = "host"
    fd, path = tempfile.mkstemp(prefix="demo-live-", suffix=".yaml")
    with open(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return path


def clock_stats(urls: list[str]) -> dict:
    """The workers' modelled clocks, summed: late steps, resyncs (wall time given up), max lag."""
    import httpx

    out = {"steps": 0, "late_steps": 0, "resyncs": 0, "lost_wall_s": 0.0, "max_lag_s": 0.0}
    for u in urls:
        try:
            st = httpx.get(u + "/server_info", timeout=10).json()["internal_states"][0]["model_clock"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            continue
        for k in ("steps", "late_steps", "resyncs", "lost_wall_s"):
            out[k] += st.get(k, 0)
        out["max_lag_s"] = max(out["max_lag_s"], st.get("max_lag_s", 0.0))
    return out


def queue_stats(router_url: str) -> dict | None:
    """The router's dispatch queue over the run, from its /metrics: requests released, their
    mean wait (the pool's seconds: router.time_factor) and deferrals; None when unreadable."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(router_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in (
                "smetric_dispatch_queue_wait_seconds_sum",
                "smetric_dispatch_queue_wait_seconds_count",
                "smetric_dispatch_deferrals_total",
                "smetric_dispatch_gate_seconds_sum",
            ):
                vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
    n = vals.get("smetric_dispatch_queue_wait_seconds_count", 0.0)
    return {
        "released": int(n),
        "queue_wait_mean": vals.get("smetric_dispatch_queue_wait_seconds_sum", 0.0) / n if n else None,
        "deferrals": int(vals.get("smetric_dispatch_deferrals_total", 0.0)),
        "gate_mean": vals.get("smetric_dispatch_gate_seconds_sum", 0.0) / n if n else None,
    }


def live_one(args: argparse.Namespace, spec: str, trace, show: bool, label: str) -> dict:
    """One live run of ``spec`` (``policy[+order...]``) on a fresh local stack."""
    from stack.replay.localstack import local_stack
    from stack.replay.progress import replay_with_progress

    policy, dispatch = dispatch_of(spec)
    with local_stack(
        config=stack_config(args, dispatch.to_config()),
        prefill=args.prefill,
        decode=args.decode,
        policy=policy,
        ports="auto",
        time_factor=args.time_factor,
        mooncake=not args.no_mooncake,
        workers_per_process=args.workers_per_process,
    ) as info:
        cfg, emu = pool_replay_config(args, info, info["router_url"], request_timeout(args))
        res = replay_with_progress(cfg, trace, label, show)
        res["policy"] = policy
        res["dispatch"] = dispatch.label()
        res["capacity_tokens"] = emu.get("capacity_tokens")
        res["hardware"] = emu.get("hardware")
        res["model_clock"] = clock_stats(info["prefill"] + info["decode"])
        res["queue"] = queue_stats(info["router_url"])
        return res
