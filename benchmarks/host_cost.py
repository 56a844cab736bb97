"""Where the host's time goes per request on the live path, and how far the emulator's clocks
fell behind.

    python benchmarks/host_cost.py [--prefill 8] [--decode 2] [--workers-per-process 4]
        [--time-factor 0.1] [--session-rate 0.1] [--duration 250] [--warmup 50] [--out FILE]

Brings up the local PD stack (``smetric up``: mooncake_master, emulated workers in pools, the
router), replays the shipped agentic slice through it with ``smetric replay``'s load model, and
prints per process the CPU seconds it spent during the replay (``/proc/PID/stat``, user +
system) per request sent, the replay client's own, and the workers' accounting of where a
request's TTFT went: the wall TTFT each role saw, the engine's modelled TTFT and the host
time before the engine (parse, tokenize, hash). Then everything is stopped again.

Run it on an idle machine (note ``uptime`` beside the figures): on a shared one the CPU
seconds hold, the wall-based TTFTs do not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def cpu_seconds(state: dict) -> dict[str, float]:
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in state["processes"]:
        try:
            f = Path(f"/proc/{p['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p["name"]] = (int(f[11]) + int(f[12])) / tck
    return out


def worker_accounting(urls: list[str], tf: float) -> dict:
    import httpx

    tot = {"finished": 0, "ttft_sum": 0.0, "ttft_model_sum": 0.0, "host_before_engine_s": 0.0}
    clock = {"steps": 0, "late_steps": 0, "resyncs": 0, "lost_wall_s": 0.0, "max_lag_s": 0.0}
    for u in urls:
        st = httpx.get(u + "/server_info", timeout=10).json()["internal_states"][0]
        for k in tot:
            tot[k] += st.get(k, 0)
        for k in clock:
            v = st["model_clock"].get(k, 0)
            clock[k] = max(clock[k], v) if k == "max_lag_s" else clock[k] + v
    n = max(1, tot["finished"])
    return {
        "finished": tot["finished"],
        "ttft_wall_mean_modelled_s": tot["ttft_sum"] / n / tf,
        "ttft_engine_modelled_mean_s": tot["ttft_model_sum"] / n,
        "host_before_engine_mean_modelled_s": tot["host_before_engine_s"] / n / tf,
        "model_clock": clock,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--workers-per-process", type=int, default=4)
    p.add_argument("--time-factor", type=float, default=0.1)
    p.add_argument("--session-rate", type=float, default=0.1)
    p.add_argument("--duration", type=float, default=250.0)
    p.add_argument("--warmup", type=float, default=50.0)
    p.add_argument("--max-think", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--policy", default="smetric")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)

    from stack.bench.live import session_load
    from stack.paths import default_trace
    from stack.replay.driver import ReplayConfig, run_replay
    from stack.replay.localstack import local_stack

    run_dir = Path(tempfile.mkdtemp(prefix="host-cost-"))
    load1 = os.getloadavg()[0]
    with local_stack(
        prefill=a.prefill,
        decode=a.decode,
        policy=a.policy,
        ports="auto",
        time_factor=a.time_factor,
        run_dir=run_dir,
        workers_per_process=a.workers_per_process,
    ) as info:
        state = json.loads((run_dir / "state.json").read_text())
        c0 = cpu_seconds(state)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        load = argparse.Namespace(
            session_rate=a.session_rate,
            duration=a.duration,
            warmup=a.warmup,
            seed=a.seed,
            max_think=a.max_think,
        )
        m = run_replay(
            ReplayConfig(
                target=info["router_url"],
                trace=str(default_trace()),
                load=session_load(load),
                time_factor=a.time_factor,
                request_timeout=max(30.0, 3000 * a.time_factor),
                tokenizer=info["tokenizer"],
            )
        )
        wall = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = cpu_seconds(state)
        roles = {
            "prefill": worker_accounting(info["prefill"], a.time_factor),
            "decode": worker_accounting(info["decode"], a.time_factor),
        }
    n = max(1, int(m.get("requests_sent") or 0))
    per = {k: (c1.get(k, 0.0) - c0[k]) for k in c0}
    per["replay client"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    total = sum(per.values())
    print(
        f"{n} requests sent ({m.get('requests')} measured, {m.get('errors')} errors) in {wall:.0f} s wall; "
        f"load average {load1:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"{'process':18s} {'cpu s':>7s} {'ms/request':>11s}")
    for k, v in per.items():
        print(f"{k:18s} {v:7.2f} {1000 * v / n:11.1f}")
    print(f"{'total':18s} {total:7.2f} {1000 * total / n:11.1f}  ({total / wall:.2f} cores busy on average)")
    for role, acc in roles.items():
        print(
            f"{role}: mean TTFT seen {acc['ttft_wall_mean_modelled_s']:.2f} modelled s, engine's modelled "
            f"{acc['ttft_engine_modelled_mean_s']:.2f} s, host before the engine "
            f"{acc['host_before_engine_mean_modelled_s']:.2f} s; clock {acc['model_clock']}"
        )
    print(
        f"client: TTFT p50 {m.get('ttft_p50')} p90 {m.get('ttft_p90')} mean {m.get('ttft_mean')} (modelled s)"
    )
    if a.out:
        doc = {
            "settings": vars(a),
            "requests_sent": n,
            "wall_s": wall,
            "cpu_s": per,
            "roles": roles,
            "replay": m,
        }
        Path(a.out).write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
