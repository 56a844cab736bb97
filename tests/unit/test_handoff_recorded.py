"""The PD hand-off fitted from a recording of the router's traffic (``smetric calibrate
--handoff-from``): each streamed PD first token less the router's queue wait and the prefill
worker's own queue and forwards, binned by prompt length, each bin's median."""

from __future__ import annotations

import random

import orjson
import pytest
import yaml

from stack.calibrate.handoff import RecordedFirst, fit_recorded, recorded_firsts
from stack.cli import main
from stack.config import RecordConfig
from stack.core.cost_model import load_hardware, quantile_at
from stack.core.observations import Observation
from stack.prefill_router.record import RecordedTrace, Recorder, Served
from stack.prefill_router.tracing import NULL_TRACE

FIXED, PER_TOKEN = 0.08, 20e-6


def _line(tokens: int, beyond: float, *, tf: float = 1.0, wait_ms: float = 0.0, **kw) -> dict:
    queue, fwd = 0.05, 0.001 * tokens
    ttft_s = (wait_ms / 1000.0) / tf + queue + fwd + beyond
    line = {
        "input_length": tokens,
        "outcome": "ok",
        "stream": True,
        "decode": "http://d",
        "time_factor": tf,
        "ttft_ms": ttft_s * tf * 1000.0,
        "router_wait_ms": wait_ms or None,
        "prefill_queue_s": queue,
        "prefill_forward_s": fwd,
        "cached_tokens": 0,
    }
    line.update(kw)
    return line


def test_only_streamed_answered_pd_first_tokens_with_the_workers_timing_count():
    lines = [
        _line(100, 0.1),
        _line(100, 0.1, stream=False),  # its time is the whole answer
        _line(100, 0.1, outcome="http_503"),
        _line(100, 0.1, decode=None),  # colocated: no hand-off
        _line(100, 0.1, prefill_forward_s=None),  # no meta_info read
        _line(100, 0.1, tf=0.01, wait_ms=3.0),  # an emulated pool's wall times, its seconds out
    ]
    got = recorded_firsts(lines)
    assert len(got) == 2
    assert got[0].beyond == pytest.approx(0.1) and got[1].beyond == pytest.approx(0.1)
    assert got[1].before == pytest.approx(0.3 + 0.05 + 0.1)  # 3 ms wall at 0.01: 0.3 s waited


def test_a_request_that_arrived_behind_another_on_its_prefill_worker_is_left_out():
    """SGLang's PD prefill worker holds a request that arrives during another's forward in its
    bootstrap queue, out of ``prefill_queue_s``: its wait would read as hand-off. Left out:
    one that arrived while another on the same prefill worker had not had its first token."""
    p, q = "http://p1", "http://p2"
    lines = [
        _line(100, 0.1, timestamp=1000, prefill=p),  # its first token at 1000 + 251 ms
        _line(100, 0.1, timestamp=1100, prefill=p),  # arrived behind the first: left out
        _line(100, 0.1, timestamp=1120, prefill=q),  # another prefill worker: kept
        _line(100, 0.1, timestamp=1400, prefill=p),  # after both first tokens on p: kept
        _line(100, 0.1, timestamp=1401, prefill=p, stream=False),  # not timed, yet it was there
        _line(100, 0.1, timestamp=1402, prefill=p),  # behind the two before it: left out
    ]
    got = recorded_firsts(lines)
    assert len(got) == 3


def test_the_fit_finds_the_typical_path_not_the_least():
    """Per-request noise with a long tail (a busy pool): the bins' medians give the terms, the
    fastest request would not."""
    rng = random.Random(0)
    firsts = []
    for _ in range(400):
        n = int(64 * 16 ** rng.random())
        noise = rng.choice([0.0, 0.0, 0.0, 0.005, -0.005, 0.3])  # one in six far slower
        before = 0.01 + 0.001 * n
        firsts.append(RecordedFirst(n, before + FIXED + PER_TOKEN * n + noise, before))
    f = fit_recorded(firsts, levels=8, holdout_every=3, kv_bytes_per_token=1000)
    fixed, per_token = f.fit.coef
    assert fixed == pytest.approx(FIXED, rel=0.15)
    assert per_token == pytest.approx(PER_TOKEN, rel=0.3)
    assert f.handoff.bootstrap_s == fixed
    assert f.handoff.transfer_gbps == pytest.approx(1000 * 8 / (per_token * 1e9))
    assert f.fit.n_holdout >= 2 and f.ttft_holdout_mape < f.ttft_prefill_only_mape
    # the spread keeps the tail the line leaves out: most requests on it, one in six 0.3 s later
    q = f.handoff.spread_s
    assert len(q) == 21 and abs(quantile_at(q, 0.5)) < 0.01 and quantile_at(q, 0.9) > 0.25


def test_no_timed_first_token_is_a_clear_error():
    with pytest.raises(ValueError, match="router.cost_model"):
        fit_recorded(recorded_firsts([_line(100, 0.1, prefill_forward_s=None)]), 6, 3, 1000)


def test_the_recorder_writes_the_waits_and_the_workers_timing(tmp_path):
    rec = Recorder(RecordConfig(enabled=True, dir=str(tmp_path)), "r", 64)
    t = RecordedTrace(NULL_TRACE, rec, Served(1_700_000_000_000, "chat", 130, [1, 2], None, True))
    t.queue_wait(0, 4_000_000, "released")
    t.prefill_timed(Observation(new_tokens=66, cached_tokens=64, forward_s=0.2, queue_s=0.03))
    t.first_token()
    t.end(200)
    rec.close()
    (path,) = tmp_path.glob("record-r-*.jsonl")
    line = orjson.loads(path.read_bytes())
    assert line["router_wait_ms"] == pytest.approx(4.0)
    assert (line["prefill_queue_s"], line["prefill_forward_s"], line["cached_tokens"]) == (0.03, 0.2, 64)


def test_calibrate_handoff_from_writes_the_base_with_the_fitted_terms(tmp_path, capsys):
    rng = random.Random(1)
    lines = [_line(n, FIXED + PER_TOKEN * n) for n in (int(64 * 16 ** rng.random()) for _ in range(200))]
    rec = tmp_path / "rec"
    rec.mkdir()
    (rec / "record-r-0.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    out = tmp_path / "pool-pd.yaml"
    rc = main(["calibrate", "--handoff-from", str(rec), "--base", "h20", "--out", str(out), "--plot", "none"])
    assert rc == 0, capsys.readouterr()
    hw = load_hardware(str(out))
    assert hw.handoff.bootstrap_s == pytest.approx(FIXED, rel=0.02)
    assert hw.cost == load_hardware("h20").cost  # every other key from --base
    prov = yaml.safe_load(out.read_text())["calibration"]["handoff"]
    assert prov["from_recording"] == str(rec) and prov["holdout_points"] >= 1
    # SGLang's prefill workers hand over between forwards: written unless told otherwise
    assert hw.handoff.between_forwards and prov["between_forwards"] is True
    rc = main(
        ["calibrate", "--handoff-from", str(rec), "--base", "h20", "--out", str(out), "--plot", "none"]
        + ["--no-handoff-between-forwards"]
    )
    assert rc == 0 and not load_hardware(str(out)).handoff.between_forwards


def test_calibrate_refuses_both_ways_and_a_missing_recording(tmp_path, capsys):
    out = str(tmp_path / "x.yaml")
    assert main(["calibrate", "--handoff", "http://x", "--handoff-from", str(tmp_path), "--out", out]) != 0
    assert main(["calibrate", "--handoff-from", str(tmp_path / "none"), "--out", out]) != 0
    err = capsys.readouterr().err
    assert "give one" in err and "no such file" in err
