"""The learned cost model end to end: an emulated PD pool runs calibration A (h20), the router is
configured with calibration B (h200) and ``router.cost_model: learn``. Fed prefills one at a
time, the router's fit converges to A and becomes the model it prices with (SMetric's stick /
migrate decision follows); under concurrent load the shared prefills are recorded and left out
of the fit; a pool without ``--enable-metrics`` gives nothing to learn and the router stays on
B. No request fails because of learning; a streamed chat answer still streams (the prefill
half alone is asked non-streamed for its meta_info)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import yaml

from stack.config import parse_config
from stack.core.cost_model import CostModel, load_hardware
from stack.core.types import ClusterView, DecisionKind, InstanceState, Request
from stack.launch.loopback import Procs
from stack.models.tiny import build_tiny_model
from stack.worker.fake import ServerThread

pytestmark = pytest.mark.timeout(180)

A = load_hardware("h20")
TOKEN = "learn-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TF = 0.2  # wall seconds per modelled second: prefills of 10-120 ms, so concurrent ones overlap


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two prefill workers with --enable-metrics, one without, one decode worker; calibration A."""
    d = tmp_path_factory.mktemp("learn")
    on = d / "metrics.yaml"
    on.write_text(yaml.safe_dump({"launch": {"emulator": {"enable_metrics": True}}}))
    common = dict(hardware="h20", time_factor=TF, kv_transport="http", bootstrap_timeout_s=20)
    with Procs(d) as p:
        pre = [p.worker("prefill", config=str(on), **common) for _ in range(2)]
        mute = p.worker("prefill", **common)
        dec = p.worker("decode", config=str(on), **common)
        yield pre, mute, dec, build_tiny_model(d / "tiny")


def _router(monkeypatch, prefill, decode, model_dir, **cost_model):
    from stack.prefill_router.service import create_app

    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", TOKEN)
    cfg = parse_config(
        {
            "model": {"name": "tiny", "path": str(model_dir), "page_size": 64, "context_length": 65536},
            "router": {
                "hardware": "h200",
                "admin_token_env": "SMETRIC_TEST_ADMIN_TOKEN",
                "health_interval_s": 0.5,
                "cost_model": {"mode": "learn", "min_observations": 20, "refit_every": 5, **cost_model},
                "dispatch": {"order": "immediate"},
            },
            "prefill": [{"url": w.url, "bootstrap_port": w.bootstrap_port} for w in prefill],
            "decode": [{"url": decode.url}],
        }
    )
    app = create_app(cfg)
    return app.state.router, ServerThread(app).start()


def _generate(c: httpx.Client, ids: list[int]) -> httpx.Response:
    return c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})


def _sizes(rng: random.Random, k: int):
    """(cached prefix, new tokens) pairs spanning 64..6000 new tokens."""
    for _ in range(k):
        yield rng.choice([0, 0, 1024, 4096]), rng.choice([64, 300, 1200, 3000, 6000])


def test_router_learns_the_pools_model_and_prices_with_it(pool, monkeypatch):
    pre, _mute, dec, model_dir = pool
    state, srv = _router(monkeypatch, pre, dec, model_dir)
    rng = random.Random(1)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            policy = state.policy
            view = ClusterView(0.0, [InstanceState(0, queued_seconds=1.5, local_hit=12000), InstanceState(1)])
            followup = Request(16000, turn=3, est_hit=12000)
            assert policy.choose(followup, view).kind == DecisionKind.STICK  # priced with B
            for cached, new in _sizes(rng, 40):  # one at a time: every prefill runs alone
                prefix = [rng.randrange(100, 30000) for _ in range(cached)]
                if prefix:
                    assert _generate(c, prefix).status_code == 200
                r = _generate(c, prefix + [rng.randrange(100, 30000) for _ in range(new)])
                assert r.status_code == 200, r.text
            # a streamed chat answer still streams to the client, event by event
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 50}], "stream": True}
            with c.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 4}) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                frames = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
            assert frames[-1] == "data: [DONE]" and len(frames) >= 4
            assert "meta_info" not in "".join(frames)  # the client's answer is SGLang's, unchanged

            st = c.get("/admin/cost_model", headers=AUTH).json()
            assert st["active"] == "learned", st
            learned = st["learned"]["coefficients"]
            for k in ("c_linear", "c_attn", "c_fwd"):  # the emulator's modelled clock is exact
                assert learned[k] == pytest.approx(getattr(A.cost, k), rel=0.02), (k, st)
            assert st["switches"] == 1
            d = policy.choose(followup, view)  # the same policy object, now priced with A
            assert d.kind == DecisionKind.MIGRATE and d.instance == 1

            # under load: overlapping prefills share forwards, are recorded, and are not fitted
            def one(i: int) -> int:
                ids = [random.Random(100 + i).randrange(100, 30000) for _ in range(2000 + 300 * i)]
                return _generate(c, ids).status_code

            with ThreadPoolExecutor(12) as ex:
                assert list(ex.map(one, range(24))) == [200] * 24
            st = c.get("/admin/cost_model", headers=AUTH).json()
            assert st["observations"]["shared"] >= 4 and st["active"] == "learned"
            state.learner.refit()
            for k in ("c_linear", "c_attn", "c_fwd"):
                assert getattr(state.cost, k) == pytest.approx(getattr(A.cost, k), rel=0.02), k

            # exports: the observations for `smetric calibrate --from`, the model as a file
            rows = c.get("/admin/cost_model/observations", headers=AUTH).text.splitlines()
            assert len(rows) == st["observations"]["held"]
            assert {"new_tokens", "forward_s", "alone"} <= set(orjson.loads(rows[0]))
            assert c.get("/admin/cost_model/observations?format=csv", headers=AUTH).text.startswith(
                "new_tokens,"
            )
            text = c.get("/admin/cost_model/calibration", headers=AUTH).text
            assert c.get("/admin/cost_model", headers={}).status_code == 401
            metrics = c.get("/metrics").text
            assert 'smetric_cost_model_switches_total{to="learned"} 1.0' in metrics
            assert "smetric_cost_model_learned_active 1.0" in metrics
    finally:
        srv.stop()
    path = model_dir.parent / "learned.yaml"
    path.write_text(text)
    assert load_hardware(str(path)).cost.c_linear == pytest.approx(A.cost.c_linear, rel=0.02)


def test_no_timings_no_learning_and_no_failed_request(pool, monkeypatch):
    _pre, mute, dec, model_dir = pool
    state, srv = _router(monkeypatch, [mute], dec, model_dir)
    rng = random.Random(2)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for _cached, new in _sizes(rng, 25):
                assert _generate(c, [rng.randrange(100, 30000) for _ in range(new)]).status_code == 200
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and "meta_info" not in r.json()
            st = c.get("/admin/cost_model", headers=AUTH).json()
            assert st["active"] == "configured" and st["observations"]["held"] == 0
            assert "smetric_cost_model_missing_timings_total 26.0" in c.get("/metrics").text
            assert c.get("/admin/cost_model/calibration", headers=AUTH).status_code == 409
            assert state.cost.c_linear == load_hardware("h200").cost.c_linear
    finally:
        srv.stop()


def _messages(c: httpx.Client, words: int, seed: int, stream: bool = False) -> httpx.Response:
    rng = random.Random(seed)
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    return c.post("/v1/messages", json=body)


def test_learns_from_messages_on_a_never_idle_pool(pool, monkeypatch):
    """Convergence under load: Anthropic Messages traffic from 8 clients that resend at once
    (the prefill workers are busy nearly all the time) gives a trusted fit within 160 requests
    that prices the pool's prefills within 5% of A; most prefills shared their forwards, and
    batches of them were fitted."""
    pre, _mute, dec, model_dir = pool
    state, srv = _router(monkeypatch, pre, dec, model_dir)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            sizes = [64, 300, 1200, 3000, 6000]

            def one(i: int) -> int:
                return _messages(c, sizes[i % len(sizes)] // 2 + i, 1000 + i, stream=i % 3 == 0).status_code

            with ThreadPoolExecutor(8) as ex:
                assert list(ex.map(one, range(160))) == [200] * 160
            st = c.get("/admin/cost_model", headers=AUTH).json()
            assert st["observations"]["held"] == 160, st  # every Messages prefill half observed
            assert st["active"] == "learned", st
            learned = st["learned"]
            # the pool was busy: most prefills shared their forwards, and batches were fitted
            # (how many of the fitted rows are batches moves with the host's load: under a
            # loaded CI machine the emulator's steps stretch and fewer prefills overlap)
            assert st["observations"]["shared"] > st["observations"]["alone"], st
            assert learned["batched_requests_fitted"] > 0, st
            fit = CostModel(**learned["coefficients"])
            for n in (64, 300, 1200, 3000, 6000, 12000):  # prices prefills like these within 5%
                assert fit.cost(n, n) == pytest.approx(A.cost.cost(n, n), rel=0.05), (n, st)
    finally:
        srv.stop()
