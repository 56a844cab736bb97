"""The loop, closed: a live stack records what it serves while `smetric replay` drives it with
agent sessions, and the recording reads back as those sessions, with their think times, and
`smetric advise` runs on it (issue 50).

With emulated workers a prediction of the run is close to circular (the emulator runs the
simulator's cost model); what this tests is the recording, the session inference and the
replay of real arrival timing. The prediction against the live figure is measured in
docs/router.md ("Advice from a recording")."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter

import pytest
import yaml

from stack.cli import main
from stack.core.types import SLO
from stack.paths import configs_dir
from stack.replay.driver import Replay, ReplayConfig
from stack.replay.localstack import local_stack
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace, recording_lines
from support.traces import linear_sessions

pytestmark = [pytest.mark.timeout(240)]

TF = 0.01
THINK = 3.0


def test_a_recorded_live_run_reads_back_as_its_sessions(tmp_path, capsys):
    rec_dir = tmp_path / "rec"
    cfg = yaml.safe_load((configs_dir() / "local.yaml").read_text())
    cfg.setdefault("router", {})["record"] = {"enabled": True, "dir": str(rec_dir)}
    # the prefill workers' own timings, read by the router into each line (the hand-off's fit)
    cfg["router"]["cost_model"] = "observe"
    cfg["launch"]["emulator"]["enable_metrics"] = True
    cfg_path = tmp_path / "local-record.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    trace_path = linear_sessions(
        tmp_path / "t.jsonl", sessions=6, turns=4, first_blocks=30, growth=8, think=THINK
    )
    with local_stack(
        config=cfg_path,
        prefill=2,
        decode=1,
        ports="auto",
        time_factor=TF,
        mooncake=False,
        run_dir=tmp_path / "run",
    ) as info:
        import httpx

        tok = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()["tokenizer_path"]
        rp = Replay(
            ReplayConfig(
                target=info["router_url"],
                trace=str(trace_path),
                load=LoadSpec(session_rate=0.1, duration=300.0, warmup=0.0, seed=1),
                time_factor=TF,
                request_timeout=20.0,
                tokenizer=tok,
                slo=SLO(b=60.0),
            )
        )
        m = asyncio.run(rp.run())
        assert m["errors"] == 0, m["error_examples"]
    # the stack is down: the router wrote what it had queued
    trace = load_trace(rec_dir)
    sent = rp.outcomes
    assert len(trace.requests) == len(sent) >= 8
    # one inferred session per session the replay started, each with its turns
    turns_sent = sorted(Counter(o.copy for o in sent).values())
    assert sorted(len(s) for s in trace.sessions) == turns_sent
    assert all(r.turn == 1 + trace.sessions[r.session].index(r.idx) for r in trace.requests)
    # the prompts as the router counted them, the outputs as the answers gave them
    assert sorted(r.input_len for r in trace.requests) == sorted(o.prompt_tokens for o in sent)
    # real arrival timing: a follow-up came its think time after its parent's answer (in the
    # pool's seconds: the recording carries the router's time factor)
    thinks = [r.think for r in trace.requests if r.prev >= 0]
    gaps = [r.timestamp - trace.requests[r.prev].timestamp for r in trace.requests if r.prev >= 0]
    assert thinks and min(thinks) >= THINK - 0.2, thinks  # never before the think time was up
    assert statistics.median(thinks) < statistics.median(gaps)  # from the answer, not the arrival
    # every answer read to its end (the replay closes a stream once it has [DONE]: not a client
    # that left), most with the prefill worker's own timing
    lines = recording_lines(rec_dir)
    assert {x["outcome"] for x in lines} == {"ok"}, Counter(x["outcome"] for x in lines)
    timed = [x for x in lines if x["prefill_forward_s"] is not None]
    assert len(timed) >= 0.8 * len(lines)
    assert all(x["ttft_ms"] / 1000 / TF >= x["prefill_forward_s"] for x in timed)
    # the PD hand-off fitted from them: the path beyond the prefill, in the pool's seconds
    pd_file = tmp_path / "h20-pd.yaml"
    rc = main(["calibrate", "--handoff-from", str(rec_dir), "--base", "h20", "--out", str(pd_file)])
    assert rc == 0
    ho = yaml.safe_load(pd_file.read_text())["calibration"]["handoff"]
    assert ho["train_points"] >= 2 and len(yaml.safe_load(pd_file.read_text())["handoff"]["spread_s"]) == 21
    capsys.readouterr()
    # and advise runs on it (the recorded arrivals, two instances as the stack had)
    rc = main(
        ["advise", "--trace", str(rec_dir), "--instances", "2", "--policies", "least-load", "--growth", "1"]
        + ["--hbm-tokens", "200000", "--jobs", "1", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "recommended: " in out and "router:" in out
