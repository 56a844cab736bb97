"""``smetric calibrate``: the design, the fit, the observation files, and the sweep against an
emulated worker whose calibration is known (h200 at time factor 1.0): engine-side timings
(``--enable-metrics``, the modelled clock) recover it to 1%; client-side times, streamed and
split at the answer's headers, give it plus the little host work after them."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import orjson
import pytest
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from stack.calibrate.design import make_design
from stack.cli import main
from stack.core.cost_model import CostModel, load_hardware
from stack.core.fit import Sample, fit_prefill, forwards
from stack.core.observations import Observation, from_meta, read_observations, to_csv, to_jsonl
from stack.launch.loopback import Procs

pytestmark = pytest.mark.timeout(120)

H200 = load_hardware("h200")
#: a small sweep (~25 s of modelled prefill + decode at time factor 1)
SMALL = ["--max-context", "16384", "--max-new", "8192", "--new-levels", "4", "--cached-levels", "3"]
SMALL += ["--repeats", "2", "--decode-contexts", "1", "--decode-steps", "16"]


def test_design_spans_new_and_cached_and_holds_points_out():
    d = make_design(32768, 16384, repeats=3, holdout_every=5)
    pts = sorted(d.prefill, key=lambda p: p.index)
    assert {p.new_tokens for p in pts} >= {128, 16384}
    assert {p.cached_tokens for p in pts if p.new_tokens == 128} >= {0, 32640}
    assert all(p.context <= 32768 for p in pts)
    held = [p.index for p in pts if p.holdout]
    assert held == [i for i in range(len(pts)) if (i + 1) % 5 == 0]
    assert [p.index for p in d.prefill] != [p.index for p in pts]  # run in a shuffled order
    assert {(p.context, p.steps) for p in d.decode} and all(p.steps >= 2 for p in d.decode)
    assert forwards(16385, 16384) == 2 and forwards(100, None) == 1
    with pytest.raises(ValueError):
        make_design(100, 100)


def test_nnls_recovers_a_model_from_noisy_samples():
    true = CostModel(3.0e-5, 4.0e-9, 0.02)
    rng = random.Random(3)
    samples = []
    for i, (n, c) in enumerate((n, c) for n in (100, 400, 1600, 6400) for c in (0, 3000, 12000)):
        for _ in range(3):
            t = true.cost(n, n + c) * (1 + rng.gauss(0, 0.01))
            samples.append(Sample((n, n + c), t, i, (i + 1) % 5 == 0))
    got, fit = fit_prefill(samples, 8192)
    assert got.c_linear == pytest.approx(true.c_linear, rel=0.05)
    assert got.c_attn == pytest.approx(true.c_attn, rel=0.05)
    assert got.c_fwd == pytest.approx(true.c_fwd, rel=0.05)
    assert fit.n_holdout == 2 and fit.holdout_mape < 0.03
    with pytest.raises(ValueError, match="too few"):
        fit_prefill(samples[:3], 8192)


def test_observations_round_trip_and_meta_info(tmp_path):
    obs = [Observation(1000, 24, 0.05, 0.001, True, "p0", 1.0), Observation(10, 0, 0.02, 0.3, False)]
    (tmp_path / "o.jsonl").write_bytes(to_jsonl(obs))
    (tmp_path / "o.csv").write_text(to_csv(obs))
    for name in ("o.jsonl", "o.csv"):
        back = read_observations(tmp_path / name)
        assert [(o.new_tokens, o.cached_tokens, o.alone) for o in back] == [(1000, 24, True), (10, 0, False)]
    (tmp_path / "bad.csv").write_text("new_tokens,forward_s\n100,abc\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        read_observations(tmp_path / "bad.csv")
    (tmp_path / "miss.jsonl").write_text('{"new_tokens": 5}\n')
    with pytest.raises(ValueError, match="forward_s"):
        read_observations(tmp_path / "miss.jsonl")
    meta = {
        "prompt_tokens": 300,
        "cached_tokens": 100,
        "queue_time": 0.002,
        "forward_entry_time": 1000.5,
        "prefill_finished_time": 1000.75,
    }
    ob = from_meta(meta, "w")
    assert (ob.new_tokens, ob.context, ob.forward_s, ob.queue_s) == (200, 300, 0.25, 0.002)
    assert from_meta({"prompt_tokens": 3}) is None  # no --enable-metrics: nothing to learn
    assert from_meta({**meta, "finish_reason": {"type": "abort"}}) is None


def test_from_file_fits_recorded_observations(tmp_path):
    true = H200.cost
    rows = []
    for i in range(60):
        n, c = 128 * (1 + i % 12) * (1 + i % 5), 2048 * (i % 7)
        rows.append(Observation(n, c, true.cost(n, n + c), 0.0, i % 9 != 0))
    rows.append(Observation(512, 0, 99.0, 0.0, False))  # shared a batch: left out
    src = tmp_path / "obs.jsonl"
    src.write_bytes(to_jsonl(rows))
    out = tmp_path / "learned.yaml"
    assert main(["calibrate", "--from", str(src), "--out", str(out), "--base", "h200", "--plot", "none"]) == 0
    hw = load_hardware(str(out))
    assert hw.cost.c_linear == pytest.approx(true.c_linear, rel=0.01)
    assert hw.cost.c_attn == pytest.approx(true.c_attn, rel=0.01)
    assert hw.cost.c_fwd == pytest.approx(true.c_fwd, rel=0.01)
    prov = yaml.safe_load(out.read_text())["calibration"]
    assert prov["prefill"]["holdout_mape"] < 0.01 and prov["prefill"]["holdout_points"] > 0


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """One colocated emulated worker at h200, time factor 1.0, with --enable-metrics."""
    d = tmp_path_factory.mktemp("calib")
    cfg = d / "emu.yaml"
    cfg.write_text(yaml.safe_dump({"launch": {"emulator": {"enable_metrics": True}}}))
    with Procs(d) as p:
        yield p.worker("colocated", hardware="h200", time_factor=1.0, config=str(cfg))


def test_engine_side_timings_recover_the_emulators_calibration(emulated, tmp_path):
    out = tmp_path / "m.yaml"
    args = [
        "calibrate",
        "--target",
        emulated.url,
        "--out",
        str(out),
        "--timing",
        "metrics",
        "--plot",
        "none",
        *SMALL,
    ]
    assert main(args) == 0
    hw = load_hardware(str(out))
    for k in ("c_linear", "c_attn", "c_fwd"):
        assert getattr(hw.cost, k) == pytest.approx(getattr(H200.cost, k), rel=0.01), k
    assert hw.chunk_tokens == H200.chunk_tokens  # the engine's own budget, from /server_info
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["timing_mode"] == "metrics"
    assert "Prefill timings: engine-side" in out.read_text()


def test_client_side_timings_are_modelled_seconds(emulated, tmp_path):
    """Client-side times (divided by the emulator's time factor) against a worker: each
    one-token request streamed, timed from the answer's headers to its first token, so the
    prompt's upload and parse stay out. On a quiet machine the default design recovers all
    three terms within 5% (docs/calibrate.md has the command and the figures); a shared CI
    machine stretches wall clocks, so this checks the sense of the result, not its precision."""
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "--target", emulated.url, "--out", str(out), "--timing", "client", *SMALL]) == 0
    hw = load_hardware(str(out))
    for k in ("c_linear", "c_attn", "c_fwd"):
        assert 0.5 < getattr(hw.cost, k) / getattr(H200.cost, k) < 2.0, k
    assert 0.5 < hw.decode_tpot_s / H200.decode_tpot_s < 2.0
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["timing_mode"] == "client"
    assert data["calibration"]["client_clock"] == "stream"
    assert data["calibration"]["repeats_reduced_to"] == "median"
    assert "from the answer's headers to its first token" in out.read_text()
    assert (tmp_path / "c.png").stat().st_size > 10_000  # predicted vs measured, by default
    samples = (tmp_path / "c.samples.jsonl").read_text().splitlines()
    assert len(samples) == 2 * (12 + 1)  # every raw measurement: 12 prefill + 1 decode points x 2


def test_the_streamed_clock_leaves_the_parse_out_and_wall_keeps_it(tmp_path):
    """A target that takes 0.4 s to parse a body (before its headers) and 0.1 s more to its
    first token: ``client`` times the 0.1 s, ``wall`` the whole 0.5 s, and each run names its
    clock and reduction."""
    from stack.calibrate.measure import Meter
    from stack.calibrate.run import reduce_for
    from stack.calibrate.target import probe
    from stack.worker.fake import ServerThread

    app = FastAPI()

    @app.get("/server_info")
    def info():
        return {"disaggregation_mode": "null", "chunked_prefill_size": 8192}

    @app.post("/generate")
    async def gen(request: Request):
        body = await request.json()
        time.sleep(0.4)  # the parse: before the answer's headers
        meta = {"prompt_tokens": len(body["input_ids"]), "cached_tokens": 0}
        if not body.get("stream"):
            await asyncio.sleep(0.1)
            return {"text": "x", "meta_info": meta}

        async def frames():
            await asyncio.sleep(0.1)  # the engine: after them
            yield b'data: {"text": "x", "meta_info": ' + orjson.dumps(meta) + b"}\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    srv = ServerThread(app).start()
    try:
        with httpx.Client(timeout=10) as c:
            streamed = probe(c, srv.url, "client")
            wall = probe(c, srv.url, "wall")
            assert (streamed.timing, streamed.client_clock, reduce_for(streamed)) == (
                "client",
                "stream",
                "median",
            )
            assert (wall.timing, wall.client_clock, reduce_for(wall)) == ("client", "wall", "min")
            s = Meter(c, streamed).prefill(list(range(100, 164)))
            w = Meter(c, wall).prefill(list(range(100, 164)))
    finally:
        srv.stop()
    assert s.prompt_tokens == w.prompt_tokens == 64
    assert 0.09 <= s.seconds < 0.3 <= 0.49 <= w.seconds


def test_metrics_timing_refused_without_the_flag_and_a_mute_target_refused(tmp_path, capsys):
    from stack.worker.fake import ServerThread

    mute = FastAPI()  # answers generation, but with neither meta_info nor cached-token counts

    @mute.get("/server_info")
    def info():
        return {"disaggregation_mode": "null", "chunked_prefill_size": 8192}

    @mute.post("/generate")
    def gen():
        return {"text": "x"}

    @mute.post("/v1/completions")
    def comp():
        return {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3}}

    srv = ServerThread(mute).start()
    try:
        out = tmp_path / "x.yaml"
        assert main(["calibrate", "--target", srv.url, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--enable-metrics" in err and "--enable-cache-report" in err and not out.exists()
    finally:
        srv.stop()
    with Procs(tmp_path) as p:
        plain = p.worker("colocated", hardware="h200", time_factor=0.01)
        assert main(["calibrate", "--target", plain.url, "--out", str(out), "--timing", "metrics"]) == 2
        assert "--enable-metrics" in capsys.readouterr().err and not out.exists()


def test_emulator_reports_sglangs_timings_where_sglang_does(emulated):
    """--enable-metrics: native /generate's meta_info carries the timings (modelled seconds:
    one isolated prefill's forward is its cost); a chat answer only non-streamed with
    return_meta_info (on the choice; refused on a stream); /v1/completions never."""
    import httpx

    u = emulated.url
    ids = [random.randrange(100, 1000) for _ in range(3000)]
    with httpx.Client(base_url=u, timeout=30) as c:
        m = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).json()
        meta = m["meta_info"]
        forward = meta["prefill_finished_time"] - meta["forward_entry_time"]
        assert forward == pytest.approx(H200.cost.cost(3000, 3000), rel=1e-3)
        assert meta["queue_time"] == pytest.approx(0.0, abs=1e-3)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
        plain = c.post("/v1/chat/completions", json=chat).json()
        assert "meta_info" not in plain and "meta_info" not in plain["choices"][0]
        asked = c.post("/v1/chat/completions", json={**chat, "return_meta_info": True}).json()
        assert "forward_entry_time" in asked["choices"][0]["meta_info"] and "meta_info" not in asked
        refused = c.post("/v1/chat/completions", json={**chat, "return_meta_info": True, "stream": True})
        assert refused.status_code == 400 and "stream" in refused.json()["message"]
        comp = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "return_meta_info": True}).json()
        assert "meta_info" not in comp and "meta_info" not in comp["choices"][0]
