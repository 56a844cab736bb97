"""The router's learned cost model without a network: lone observations and busy stretches, the trust
rules, the switch to the learned model and back (logged and counted), SMetric's decision
following the switch, the prefill half's body and meta_info, the calibration export, and
driver parity on the exported file."""

from __future__ import annotations

import logging
import random

import numpy as np
import orjson
import pytest

from stack.config import CostModelConfig
from stack.core.cost_model import SwitchableCost, load_hardware
from stack.core.types import SLO, ClusterView, DecisionKind, InstanceState, Request
from stack.decode_router.prefill_meta import answer_meta, meta_body
from stack.policies import PolicyContext, make_policy
from stack.prefill_router.learned_cost import CostLearner, LoneTracker

A = load_hardware("h20")  # the pool's true calibration
B = load_hardware("h200")  # what the router is configured with


_CLOCK = [1000.0]  # the engine's clock: the end of the latest prefill


def _meta(n: int, cached: int, seconds: float, queue: float = 0.0, start: float | None = None) -> dict:
    if start is None:
        start = _CLOCK[0] + 1.0
    _CLOCK[0] = max(_CLOCK[0], start + seconds)
    return {
        "prompt_tokens": n + cached,
        "cached_tokens": cached,
        "queue_time": queue,
        "forward_entry_time": start,
        "prefill_finished_time": start + seconds,
    }


def _feed(learner: CostLearner, k: int, model=A.cost, seed: int = 0, noise: float = 0.0, shared=False):
    """``k`` prefills of model ``model`` on one worker, one at a time (``shared``: in pairs whose
    forwards overlap on the engine's clock)."""
    rng = random.Random(seed)
    for i in range(k):
        n, c = rng.choice([64, 256, 1024, 4096, 8000]), rng.choice([0, 0, 2048, 16384])
        t = learner.begin("http://p0")
        secs = model.cost(n, n + c) * (1 + rng.uniform(-noise, noise))
        start = _CLOCK[0] - 0.001 if shared and i % 2 else None  # overlaps the previous one
        learner.record(t, _meta(n, c, secs, start=start))
        learner.end(t)


def _learner(mode="learn", **kw):
    cfg = CostModelConfig(mode=mode, min_observations=20, refit_every=5, **kw)
    switch = SwitchableCost(B.cost)
    return CostLearner(B, cfg, None, switch), switch


def test_lone_tracker_marks_overlaps_with_unobserved_prefills():
    """Two observed prefills are judged on the engine's clock; one the router sent without
    asking for timings (a path with no meta_info) marks every observed one it overlaps."""
    tr = LoneTracker()
    a = tr.begin("w0")
    b = tr.begin("w1")  # another worker
    c = tr.begin("w0")  # observed too: left to the engine-side intervals
    assert not (a.shared or b.shared or c.shared)
    u = tr.begin("w0", observed=False)
    assert a.shared and c.shared and not b.shared
    for t in (a, c, u):
        tr.end(t)
    d = tr.begin("w0")
    assert not d.shared


def test_engine_side_intervals_mark_both_overlapping_prefills():
    learner, _ = _learner()
    first = learner.record(learner.begin("w"), _meta(1000, 0, 0.5, start=5000.0))
    apart = learner.record(learner.begin("w"), _meta(1000, 0, 0.5, start=5001.0))
    other = learner.record(learner.begin("v"), _meta(1000, 0, 0.5, start=5001.2))  # another worker
    late = learner.record(learner.begin("w"), _meta(1000, 0, 0.5, start=5001.4))  # overlaps `apart`
    assert first.alone and other.alone
    assert not apart.alone and not late.alone


def test_converges_to_the_pools_model_and_switches_once(caplog):
    learner, switch = _learner()
    caplog.set_level(logging.WARNING, "stack.router")
    _feed(learner, 10)
    assert switch.model == B.cost and not learner.using_learned  # too few observations
    assert any("lone observations" in r for r in learner.verdict.reasons)
    _feed(learner, 30, seed=1)
    assert learner.using_learned and learner.switches == 1
    for k in ("c_linear", "c_attn", "c_fwd"):
        assert getattr(switch, k) == pytest.approx(getattr(A.cost, k), rel=1e-3)
    assert switch.cost(4000, 16000) == pytest.approx(A.cost.cost(4000, 16000), rel=1e-3)
    assert "learned fit is trusted" in caplog.text
    st = learner.status()
    assert st["active"] == "learned" and st["learned"]["trusted"] and st["observations"]["alone"] == 40


def test_smetric_decision_follows_the_switch():
    """Sticking is on time under B's (fast) model and late under A's: the same policy object
    sticks before the router has learned the pool, and migrates after."""
    learner, switch = _learner()
    policy = make_policy("smetric", PolicyContext(switch, SLO(), 64))
    view = ClusterView(
        now=0.0,
        instances=[InstanceState(0, queued_seconds=1.5, local_hit=12000), InstanceState(1)],
    )
    req = Request(16000, turn=3, est_hit=12000)
    assert policy.choose(req, view).kind == DecisionKind.STICK
    _feed(learner, 40)
    assert learner.using_learned
    d = policy.choose(req, view)
    assert d.kind == DecisionKind.MIGRATE and d.instance == 1


def test_falls_back_on_bad_observations_and_counts_the_switch(caplog):
    learner, switch = _learner(buffer=40)
    _feed(learner, 40)
    assert learner.using_learned
    caplog.set_level(logging.WARNING, "stack.router")
    rng = random.Random(5)
    for _ in range(40):  # the pool now answers at random: no model fits
        t = learner.begin("http://p0")
        learner.record(t, _meta(rng.choice([64, 4096]), 0, rng.uniform(0.001, 5.0)))
        learner.end(t)
    assert not learner.using_learned and switch.model == B.cost
    assert learner.switches == 2 and any("MAPE" in r for r in learner.verdict.reasons)
    assert "no longer trusted" in caplog.text


def test_narrow_span_and_insane_coefficients_are_not_trusted():
    learner, switch = _learner()
    for _ in range(40):  # every prefill the same size: c_linear cannot be told from c_fwd
        t = learner.begin("w")
        learner.record(t, _meta(1000, 0, A.cost.cost(1000, 1000)))
        learner.end(t)
    assert not learner.using_learned and any("span" in r for r in learner.verdict.reasons)
    slow = type(A.cost)(0.05, 0.0, 0.0)  # 50 ms a token: outside the sane bounds
    learner2, switch2 = _learner()
    _feed(learner2, 40, model=slow)
    assert not learner2.using_learned and any("c_linear" in r for r in learner2.verdict.reasons)


def _batch(learner: CostLearner, worker: str, sizes, model=A.cost, queue: float = 0.0, end=True):
    """Prefills of ``sizes`` (new tokens, no cache) sharing their forwards on ``worker``: one busy
    stretch as the engine reports it (the same first forward; the last finishes when the
    stretch's ``sum`` of request terms plus ``c_fwd`` per forward has run)."""
    from stack.core.fit import forwards

    start = _CLOCK[0] + 1.0
    span = sum(model.cost(n, n) - model.c_fwd * forwards(n, learner.chunk_tokens) for n in sizes)
    span += model.c_fwd * forwards(sum(sizes), learner.chunk_tokens)
    tickets = [learner.begin(worker) for _ in sizes]
    for i, (t, n) in enumerate(zip(tickets, sizes)):
        secs = span * (i + 1) / len(sizes)
        learner.record(t, _meta(n, 0, secs, queue=queue if i == 0 else 0.01 * i, start=start))
    if end:
        for t in tickets:
            learner.end(t)
    return tickets


def test_batched_prefills_are_fitted_as_busy_stretches():
    """A pool that is never idle: every prefill shares its forwards, and the fit learns from the
    busy stretches (their span against the work of every request in them)."""
    learner, switch = _learner()
    rng = random.Random(3)
    for _ in range(30):
        _batch(
            learner, "http://p0", [rng.choice([64, 256, 1024, 4096, 8000]) for _ in range(rng.randint(2, 4))]
        )
    learner.refit()
    st = learner.status()
    assert st["observations"]["alone"] == 0 and st["learned"]["batched_requests_fitted"] >= 60
    assert learner.using_learned and switch.c_linear == pytest.approx(A.cost.c_linear, rel=1e-3)
    assert switch.c_fwd == pytest.approx(A.cost.c_fwd, rel=1e-3)


def test_stretches_with_unseen_work_are_kept_out_of_the_fit():
    """Stretches that ran beside work the router cannot see are recorded (and exported) but
    not fitted: queued behind another client's request, beside a prefill half whose path gives
    no timing, beside one whose answer had none, or still waiting for a member's answer."""
    learner, switch = _learner()
    _feed(learner, 40)
    batch = type(A.cost)(A.cost.c_linear * 3, A.cost.c_attn * 3, A.cost.c_fwd * 3)
    rows = len(learner.rows())
    for sizes in ([100, 2000], [6000, 64, 512]):
        _batch(learner, "http://p1", sizes, model=batch, queue=0.2)  # behind another client's
        u = learner.begin("http://p2", observed=False)  # a path that gives no timing
        _batch(learner, "http://p2", sizes, model=batch)
        learner.end(u)
        lost = learner.begin("http://p3")  # an answer that comes back without timings
        _batch(learner, "http://p3", sizes, model=batch)
        learner.record(lost, None)
        learner.end(lost)
        pending = learner.begin("http://p4")  # sent before, not answered yet
        _batch(learner, "http://p4", sizes, model=batch)
    assert len(learner.rows()) == rows == 40
    learner.end(pending)  # it gives no timing after all: the stretch beside it stays out
    learner.refit()
    st = learner.status()
    assert st["observations"]["alone"] == 40 and st["learned"]["batched_requests_fitted"] == 0
    assert learner.using_learned and switch.c_linear == pytest.approx(A.cost.c_linear, rel=1e-3)


def test_a_stretch_waits_for_its_members_then_counts():
    learner, _ = _learner()
    pending = learner.begin("w")
    _batch(learner, "w", [100, 2000])
    assert learner.rows() == []  # ``pending`` may have shared its forwards
    learner.record(pending, _meta(300, 0, 0.5))  # it ran later, alone
    learner.end(pending)
    assert [len(g) for g in learner.rows()] == [2, 1]


def test_observe_mode_fits_but_never_switches_and_bad_meta_never_raises():
    learner, switch = _learner(mode="observe")
    _feed(learner, 40)
    assert learner.verdict.trusted and not learner.using_learned and switch.model == B.cost
    t = learner.begin("w")
    assert learner.record(t, None) is None
    assert learner.record(t, {"prompt_tokens": "x", "forward_entry_time": []}) is None
    assert learner.record(t, {**_meta(10, 0, 0.1), "finish_reason": {"type": "abort"}}) is None
    learner.end(t)


def test_prefill_half_asks_for_meta_info_where_sglang_gives_it():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    chat["stream_options"] = {"include_usage": True}
    raw = orjson.dumps({**chat, "bootstrap_room": 7})
    got = orjson.loads(meta_body("/v1/chat/completions", raw, chat))
    assert got["stream"] is False and got["return_meta_info"] is True and got["bootstrap_room"] == 7
    assert "stream_options" not in got and got["messages"] == chat["messages"]
    gen = {"input_ids": [1, 2, 3]}
    assert meta_body("/generate", b'{"input_ids":[1,2,3]}', gen) == b'{"input_ids":[1,2,3]}'
    assert meta_body("/v1/completions", b"{}", {"prompt": "x"}) is None  # never carries it
    assert meta_body("/v1/messages", b"{}", {}) is None
    assert meta_body("/generate", b"{}", {"text": ["a", "b"]}) is None  # a batch
    m = _meta(10, 0, 0.1)
    assert answer_meta(orjson.dumps({"choices": [{"meta_info": m}]})) == m
    assert answer_meta(orjson.dumps({"text": "x", "meta_info": m})) == m
    sse = b"data: " + orjson.dumps({"text": "x", "meta_info": m}) + b"\n\ndata: [DONE]\n\n"
    assert answer_meta(sse) == m
    assert answer_meta(b'{"choices": [{"message": {}}]}') is None and answer_meta(b"garbage") is None


def test_export_is_a_calibration_file_and_both_drivers_decide_alike_on_it(tmp_path):
    """The learned model, exported, is a file ``--hardware FILE`` loads; the simulator's
    policy on that file and the live policy on the learned switchable model agree on every
    state of the driver-parity test."""
    from test_driver_parity import STATES, _live, _sim

    learner, switch = _learner()
    assert learner.calibration_text() is None
    _feed(learner, 40)
    path = tmp_path / "learned.yaml"
    path.write_text(learner.calibration_text())
    hw = load_hardware(str(path))
    assert hw.cost == switch.model and hw.chunk_tokens == B.chunk_tokens and hw.name == "h200-learned"
    for name in ("smetric", "smetric-global", "smetric-b", "linear"):
        live = make_policy(name, PolicyContext(switch, SLO(), 64))
        sim = make_policy(name, PolicyContext(hw.cost, SLO(), 64))
        for i, st in enumerate(STATES):
            lv = _live(st, now=100.0 + i)
            sv = _sim(st, now=100.0 + i, fetch_tps=lv.fetch_tokens_per_s)
            req = Request(st.prompt_tokens, st.turn, st.est_hit, None)
            assert live.choose(req, lv) == sim.choose(req, sv), (name, i)


def test_messages_prefill_half_is_sglangs_own_chat_request():
    """A Messages request's prefill half: the chat request SGLang makes of it (same messages,
    tools, sampling and PD fields), non-streamed with meta_info; None where the conversion
    depends on the worker."""
    from stack.decode_router.prefill_meta import meta_request

    body = {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "system": "be brief",
        "temperature": 0.3,
        "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "ls"},
        "bootstrap_room": 7,
        "rid": "r1",
    }
    path, raw = meta_request("/v1/messages", orjson.dumps(body), body)
    chat = orjson.loads(raw)
    assert path == "/v1/chat/completions" and chat["stream"] is False and chat["return_meta_info"]
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat["tools"][0]["function"]["name"] == "ls"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert (chat["max_tokens"], chat["temperature"], chat["stop"]) == (9, 0.3, ["END"])
    assert (chat["bootstrap_room"], chat["rid"]) == (7, "r1")
    for worker_dependent in (
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]},
        {"thinking": {"type": "enabled", "budget_tokens": 2048}},
        {"output_config": {"effort": "low"}},
        {"messages": "not a list"},
    ):
        b = {**body, **worker_dependent}
        assert meta_request("/v1/messages", orjson.dumps(b), b) is None
    for odd in (
        b"{not json",
        b"[]",
        b'{"messages": [1, null]}',
        b'{"model": "m", "messages": [{"role": 3}]}',
    ):
        assert meta_request("/v1/messages", odd, {}) is None  # sent as it is; never raises
    assert meta_request("/v1/responses", orjson.dumps(body), body) is None


def test_touching_prefills_are_separate_stretches_and_refits_thin_out_with_the_buffer():
    learner, _ = _learner()  # refit_every 5
    t0 = _CLOCK[0] + 1.0
    for start, secs in ((t0, 0.5), (t0 + 0.5, 0.5), (t0 + 0.9, 0.3)):  # touch, then overlap
        t = learner.begin("w")
        learner.record(t, _meta(500, 0, secs, start=start))
        learner.end(t)
    assert [len(g) for g in learner.rows()] == [1, 2]
    refits = []
    fit = learner.refit

    def spy():
        refits.append(len(learner.held))
        return fit()

    learner.refit = spy  # type: ignore[method-assign]
    _feed(learner, 400)
    gaps = [b - a for a, b in zip(refits, refits[1:])]
    assert gaps[0] == 5 and gaps[-1] >= 19  # every twentieth of those held: a bounded cost per observation


def test_held_out_rows_are_one_per_block_at_places_that_vary():
    from stack.core.fit import held_out

    for every in range(2, 11):
        for rows in (0, every - 1, every, 7 * every + 3, 400):
            m = held_out(rows, every)
            assert len(m) == rows and m.sum() == rows // every
            blocks = np.nonzero(m)[0] // every
            assert list(blocks) == list(range(rows // every))  # one in each full block
        # the same rows at every refit: a longer buffer only adds blocks
        assert list(held_out(40 * every, every)[: 10 * every]) == list(held_out(10 * every, every))
        # every place in the block comes up, evenly
        places = np.bincount(np.nonzero(held_out(1000 * every, every))[0] % every, minlength=every)
        assert places.min() >= 0.9 * places.max() > 0
    # five sizes in turn: the first five blocks hold out each size once
    assert sorted(np.nonzero(held_out(25, 5))[0] % 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        held_out(10, 1)


def test_traffic_cycling_through_sizes_is_scored_on_all_of_them():
    """A client cycling through five prompt sizes. Every fifth row held out would score the fit
    on the largest size alone, which it never saw: with the engine 25% slower at that size than
    the three-term model, the fit on the other four is exact and misses it by 20% (untrusted).
    Held out one per block at varying places, the fit sees every size and is scored on them
    all, so the held-out error is the fit's error."""
    learner, switch = _learner()
    sizes = (64, 256, 1024, 4096, 8000)
    for i in range(30):
        n = sizes[i % 5]
        t = learner.begin("http://p0")
        learner.record(t, _meta(n, 0, A.cost.cost(n, n) * (1.25 if n == 8000 else 1.0)))
        learner.end(t)
    v = learner.verdict
    assert v.lone == 30 and v.trusted, v.reasons
    assert v.holdout_mape < 2 * v.train_mape and 0.01 < v.train_mape < 0.1, v
    assert switch.model == v.cost
