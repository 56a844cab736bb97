"""`smetric replay` over the real HTTP path: the local stack (router + emulated PD workers)
on loopback, the simulator's load model (closed loop per agent stream), the simulator's
metric names; and a replay that stops by itself, counting errors, against a dead or hung
endpoint."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from stack.config import PRODUCT_POLICY
from stack.core.types import SLO
from stack.replay.driver import Replay, ReplayConfig, run_replay
from stack.sim.load import LoadSpec
from support.traces import linear_sessions

TF = 0.01
# the keys `smetric sim` writes that a live replay must reproduce
SIM_KEYS = {
    "requests", "duration_s", "prefill_tps_within_slo", "prefill_tps", "slo_attainment", "ttft_p50",
    "ttft_p90", "ttft_p99", "ttft_mean", "imbalance_mean", "imbalance_p99", "reuse_total", "reuse_local",
    "reuse_global", "computed_tokens", "prompt_tokens", "reused_tokens", "sticks", "migrations",
    "first_turns", "balanced", "trace", "policy", "load_mode", "session_rate", "rate_scale", "requests_total",
}  # fmt: skip


@pytest.fixture(scope="module")
def stack_info(tmp_path_factory):
    import httpx

    from stack.replay.localstack import local_stack

    run_dir = tmp_path_factory.mktemp("run")
    with local_stack(
        prefill=2, decode=1, ports="auto", time_factor=TF, mooncake=False, run_dir=run_dir
    ) as info:
        si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
        info["stack_tokenizer"] = info["tokenizer"]  # what local_stack says the stack tokenizes with
        info["tokenizer"] = si["tokenizer_path"]
        info["time_factor"] = si["emulator"]["time_factor"]
        yield info


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return linear_sessions(
        tmp_path_factory.mktemp("trace") / "t.jsonl",
        sessions=6,
        turns=4,
        first_blocks=30,
        growth=8,
        think=2.0,
    )


@pytest.mark.timeout(90)
def test_replay_through_the_router(stack_info, trace_path):
    assert stack_info["time_factor"] == TF
    cfg = ReplayConfig(
        target=stack_info["router_url"],
        trace=str(trace_path),
        load=LoadSpec(session_rate=0.1, duration=300.0, warmup=0.0, seed=1),
        time_factor=TF,
        request_timeout=20.0,
        tokenizer=stack_info["tokenizer"],
        # at time factor 0.01 a wall-clock hiccup of 10 ms is a modelled second: a loose SLO
        # keeps "within SLO" about what the metric computes, not about how busy the machine is
        slo=SLO(b=60.0),
    )
    rp = Replay(cfg)
    t0 = time.monotonic()
    m = asyncio.run(rp.run())
    assert time.monotonic() - t0 < 40
    assert SIM_KEYS <= set(m), SIM_KEYS - set(m)
    assert m["errors"] == 0, m["error_examples"]
    assert m["requests"] >= 8 and m["policy"] == PRODUCT_POLICY  # configs/local.yaml runs the product
    assert m["first_turns"] >= 1 and m["sticks"] >= 1
    assert 0 < m["reuse_local"] <= m["reuse_total"] < 1
    assert m["prefill_tps_within_slo"] > 0 and m["ttft_p50"] > 0 and m["tpot_p50"] > 0
    # the server counted the prompts we built (exact with the target's tokenizer)
    by_idx = {o.idx: o for o in rp.outcomes if o.copy == rp.outcomes[0].copy}
    for o in by_idx.values():
        L = rp.trace.requests[o.idx].input_len
        assert abs(o.prompt_tokens - L) <= 64, (o.prompt_tokens, L)
        assert o.output_tokens == rp.trace.requests[o.idx].output_len
    # closed loop: a follow-up is sent only after its predecessor's answer plus think time
    for o in rp.outcomes:
        tr = rp.trace.requests[o.idx]
        if tr.prev < 0:
            continue
        p = next(x for x in rp.outcomes if x.copy == o.copy and x.idx == tr.prev)
        assert o.sent_wall >= p.sent_wall + p.e2e_wall + tr.think * TF - 0.005


@pytest.mark.timeout(90)
def test_replay_cli_writes_sim_keys(stack_info, trace_path, tmp_path):
    out = tmp_path / "live.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stack.cli",
            "replay",
            "--target",
            stack_info["router_url"],
            "--trace",
            str(trace_path),
            "--session-rate",
            "0.1",
            "--duration",
            "150",
            "--warmup",
            "0",
            "--time-factor",
            str(TF),
            "--tokenizer",
            stack_info["tokenizer"],
            "--max-inflight",
            "4",
            "--request-timeout",
            "20",
            "--out",
            str(out),
            "--no-progress",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(out.read_text())
    assert SIM_KEYS <= set(m) and m["errors"] == 0 and m["requests"] > 0
    assert m["max_inflight"] == 4 and m["time_factor"] == TF


@pytest.mark.timeout(60)
def test_replay_refuses_a_tokenizer_mismatch(stack_info, trace_path, tmp_path):
    """As `smetric replay --help` once documented it (no --tokenizer) against `smetric up`:
    the built-in words are ~2 tokens each for the stack's tiny model; refused before any
    request, naming the stack's tokenizer; the router's /model_info names the same one."""
    import httpx

    info = httpx.get(stack_info["router_url"] + "/model_info", timeout=10).json()
    assert info["tokenizer_path"] == stack_info["tokenizer"] == stack_info["stack_tokenizer"]
    args = [sys.executable, "-m", "stack.cli", "replay", "--target", stack_info["router_url"],
            "--trace", str(trace_path), "--session-rate", "0.1", "--duration", "60", "--warmup", "0",
            "--time-factor", str(TF), "--out", str(tmp_path / "x.json"), "--no-progress"]  # fmt: skip
    r = subprocess.run(args, capture_output=True, text=True, timeout=45)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "tokenizer mismatch" in r.stderr and f"--tokenizer {stack_info['tokenizer']}" in r.stderr
    assert not (tmp_path / "x.json").exists()


class _Hung:
    """A TCP server that accepts and reads but never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        self.sock.settimeout(0.1)
        while not self.stop:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                continue

    def close(self):
        self.stop = True
        self.t.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.timeout(30)
def test_replay_stops_by_itself_and_counts_errors(trace_path):
    hung = _Hung()
    try:
        cfg = ReplayConfig(
            target=f"http://127.0.0.1:{hung.port}",
            trace=str(trace_path),
            load=LoadSpec(session_rate=1.0, duration=2.0, warmup=0.0, seed=0),
            time_factor=1.0,
            request_timeout=1.0,
            drain_timeout=0.5,
            metrics_url="",
        )
        t0 = time.monotonic()
        m = run_replay(cfg)
        assert time.monotonic() - t0 < 10
        assert m["requests"] == 0 and m["errors"] >= 1
        assert set(m["error_kinds"]) <= {"timeout", "cancelled"}
        assert m["slo_attainment"] == 0.0
    finally:
        hung.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg.target = f"http://127.0.0.1:{dead}"
    m = run_replay(cfg)
    assert m["errors"] >= 1 and set(m["error_kinds"]) == {"transport"}


@pytest.mark.timeout(180)
def test_demo_live_side_by_side(trace_path, tmp_path, capsys):
    from stack.commands import demo_live

    with pytest.raises(ValueError, match="unknown policy"):
        demo_live.main(["--policies", "smetric,nope", "--trace", str(trace_path)])
    with pytest.raises(ValueError, match="--repeat"):
        demo_live.main(["--repeat", "0", "--trace", str(trace_path)])
    out = tmp_path / "demo.json"
    rc = demo_live.main(
        [
            "--policies",
            "smetric-global+slack:T=4,least-load",
            "--trace",
            str(trace_path),
            "--prefill",
            "2",
            "--decode",
            "1",
            "--workers-per-process",
            "2",
            "--time-factor",
            "0.01",
            "--duration",
            "150",
            "--warmup",
            "0",
            "--repeat",
            "2",
            "--no-mooncake",
            "--no-scale",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    # no --session-rate: the simulator chose the knee, and the live runs used it
    assert res["knee"]["rate"] == res["settings"]["session_rate"] > 0
    assert res["knee"]["attainment"] >= res["knee"]["target"] or res["knee"]["rate"] == 0.02
    assert set(res["runs"]) == {"smetric-global+slack:T=4", "least-load"}
    for pol, runs in res["runs"].items():
        assert len(runs) == 2
        for r in runs:
            name, _, order = pol.partition("+")
            assert r["policy"] == name and r["requests"] > 0 and r["errors"] == 0
            assert r["dispatch"] == (order or "immediate")
            assert r["session_rate"] == res["knee"]["rate"]
            assert r["model_clock"]["steps"] > 0
        assert res["sim"][pol]["requests"] > 0
        tps = res["summary"][pol]["prefill_tps_within_slo"]
        assert tps["live_min"] <= tps["live_mean"] <= tps["live_max"] and tps["sim"] > 0
        assert tps["gap"] == pytest.approx(tps["live_mean"] / tps["sim"] - 1)
    assert res["verdict"].startswith("verdict: ") and "at 2 instances" in res["verdict"]
    # the bands: every policy over seeds 0..9, the paired comparison, the live checks
    assert res["band_seeds"] == list(range(10))
    assert set(res["bands"]) == {"smetric-global+slack:T=4", "least-load"}
    (cmp,) = res["comparisons"]
    assert (cmp["a"], cmp["b"]) == ("smetric-global+slack:T=4", "least-load")
    assert cmp["ratio"]["p10"] <= cmp["ratio"]["median"] <= cmp["ratio"]["p90"]
    assert {c["policy"] for c in res["live_checks"]} == set(res["runs"])
    assert set(res["chaos_floor"]) == set(res["runs"])
    assert res["sim"]["smetric-global+slack:T=4"]["dispatch"] == "slack:T=4"
    assert res["sim"]["least-load"]["dispatch"] == "immediate"
    text = capsys.readouterr().out
    assert "prefill TPS within SLO" in text and "least-load" in text and "verdict:" in text
    assert "chaos floor" in text and "band" in text
    assert "knee (simulator" in text


def test_demo_live_runs_the_same_dispatch_queue_live_and_simulated():
    from stack.commands.demo_live import DEFAULT_POLICIES, dispatch_of
    from stack.config import parse_config
    from stack.dispatch import ROUTER_DISPATCH, SIM_DISPATCH

    assert dispatch_of("lmetric") == ("lmetric", SIM_DISPATCH)
    assert SIM_DISPATCH.to_config() == {"order": "immediate"}
    for spec in ("smetric-global+slack:T=4", "least-load+deadline-defer:age_k=2:max_queue=9", "x+slack"):
        _, d = dispatch_of(spec)
        live = parse_config({"router": {"dispatch": d.to_config()}}).router.dispatch.build()
        sim = d.build()
        assert type(live.order) is type(sim.order) and live.order.params() == sim.order.params()
        assert live.readiness == sim.readiness and live.max_queue == sim.max_queue
    # the default: the product against the baseline as its authors ship it
    assert [dispatch_of(p)[1].order for p in DEFAULT_POLICIES] == [ROUTER_DISPATCH.order, "immediate"]
