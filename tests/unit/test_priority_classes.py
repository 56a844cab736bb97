"""Priority classes (stack/dispatch/sglang_priority.py): one rule for the live router
and the simulator, and the same per-instance order in the simulator and the emulated
worker (SGLang's ``--enable-priority-scheduling --disable-priority-preemption``)."""

from __future__ import annotations

import math
import random
import types

import pytest

import stack.prefill_router.api.inference as inference
import stack.sim.engine as engine
from stack.core.types import SLO
from stack.dispatch import SIM_DISPATCH, DispatchSpec
from stack.dispatch.sglang_priority import (
    EDGES,
    N_CLASSES,
    class_priority,
    dispatch_priority,
    priority_class,
)
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.instance import Job, enqueue_by_class
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace
from stack.worker.request import GenParams, Req, request_priority
from stack.worker.scheduler import PrefillScheduler
from support.traces import agentic_record, write_jsonl

SLO0 = SLO()


def test_classes_are_few_monotone_and_centred_on_the_slo_base():
    slacks = [k / 100.0 for k in range(-500, 3000)]
    cs = [priority_class(s, SLO0) for s in slacks]
    assert cs == sorted(cs) and set(cs) == set(range(N_CLASSES))
    assert priority_class(-10.0, SLO0) == priority_class(0.0, SLO0) == 0  # late: most urgent
    assert priority_class(SLO0.ttft(100), SLO0) == 0  # a fresh short prompt: inside class 0
    assert priority_class(1e9, SLO0) == N_CLASSES - 1
    # half-octave classes: each edge sqrt(2) above the last, in units of the SLO's base
    assert all(math.isclose(b / a, math.sqrt(2)) for a, b in zip(EDGES, EDGES[1:], strict=False))
    half = SLO(b=0.5, a=SLO0.a)
    assert priority_class(2.0, half) == priority_class(4.0, SLO0)  # the unit scales
    assert priority_class(4.0, SLO(b=0.0, a=SLO0.a)) == priority_class(4.0, SLO0)  # b=0: 1 s
    # SGLang's value: higher runs first, one value per class
    assert [class_priority(c) for c in range(N_CLASSES)] == list(range(N_CLASSES - 1, -1, -1))
    for bad in (-1, N_CLASSES):
        with pytest.raises(ValueError, match="priority class"):
            class_priority(bad)


def test_dispatch_key_prio():
    s = DispatchSpec.parse("immediate:prio=1")
    assert s.priority and s.label() == "immediate:prio=1"
    assert s.to_config() == {"order": "immediate", "sglang_priority": True}
    q = DispatchSpec.parse("slack:T=4:prio=1")
    assert q.priority and q.to_config()["sglang_priority"] is True and q.label() == "slack:T=4:prio=1"
    assert not DispatchSpec.parse("slack:T=4").priority
    assert "sglang_priority" not in DispatchSpec.parse("slack:T=4").to_config()
    assert DispatchSpec.from_config({"order": "immediate", "sglang_priority": True}).priority
    assert not DispatchSpec.from_config({"sglang_priority": False}).priority
    with pytest.raises(ValueError, match="prio must be 0 or 1"):
        DispatchSpec.parse("immediate:prio=2")


# -- the same class in both drivers ----------------------------------------------------------
def _router_priority(L: int, waited: float, slo: SLO) -> int:
    """The live router's value for a request of ``L`` tokens dispatched ``waited`` seconds
    after its arrival: :meth:`InferenceHandler._priority` itself, its clock fixed."""
    handler = types.SimpleNamespace(state=types.SimpleNamespace(slo=slo))
    ep = types.SimpleNamespace(priority="body")
    clock = types.SimpleNamespace(perf_counter=lambda: 1000.0 + waited, time=lambda: 0.0)
    real = inference.time
    inference.time = clock  # type: ignore[assignment]
    try:
        body, _ = inference.InferenceHandler._priority(handler, L, ep, 1000.0)  # type: ignore[arg-type]
    finally:
        inference.time = real
    return body["priority"]


def test_the_router_and_the_simulator_use_one_rule():
    assert engine.priority_class is priority_class  # the simulator's (stack/sim/engine.py)
    assert inference.dispatch_priority is dispatch_priority  # the router's
    rng = random.Random(5)
    for _ in range(2000):
        L, w = rng.randrange(0, 300_000), rng.uniform(0.0, 30.0)
        assert dispatch_priority(SLO0.ttft(L), w, SLO0) == class_priority(
            priority_class(SLO0.ttft(L) - w, SLO0)
        )


def crafted_overload(tmp_path):
    """One instance busy with a 10k-token request; then a long request with a loose SLO,
    then three short ones with tight SLOs (as tests/unit/test_dispatch.py's)."""
    recs = [
        agentic_record(0, 1, 0.0, 156),
        agentic_record(1, 1, 0.3, 234),
        *[agentic_record(2 + k, 1, 0.31 + 0.001 * k, 5) for k in range(3)],
    ]
    return load_trace(write_jsonl(tmp_path / "burst.jsonl", recs))


@pytest.fixture
def hw():
    from stack.core.cost_model import CostModel, Hardware

    cost = CostModel(c_fwd=0.01, c_linear=1e-4, c_attn=0.0)
    return Hardware(
        name="test", cost=cost, hbm_kv_tokens=1_000_000, chunk_tokens=1024, kv_bytes_per_token=1000,
        gpus_per_server=2, nic_gbps=8.0, link_efficiency=1.0, decode_tpot_s=0.0,
    )  # fmt: skip


def run_sim(trace, hw, dispatch: str = "immediate", instances: int = 1, **params) -> tuple[Simulator, dict]:
    cfg = SimConfig(
        instances=instances,
        hardware=hw,
        global_tier=GlobalTierSpec.parse("full"),
        slo=SLO(b=1.0, a=2e-4),
        dispatch=SIM_DISPATCH.updated(dispatch, params),
    )
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    s = Simulator(trace, "least-load", cfg, spec)
    return s, s.run().metrics


def test_simulator_instance_runs_by_class_without_preempting(tmp_path, hw, monkeypatch):
    t = crafted_overload(tmp_path)
    _, fcfs = run_sim(t, hw)
    assert round(fcfs["slo_attainment"] * 5) == 2  # the short ones wait behind the long one
    seen: list[tuple[int, float, int]] = []

    def spy(waiting, j, cls):
        seen.append((j.L, j.qwait, cls))
        enqueue_by_class(waiting, j, cls)

    monkeypatch.setattr(engine, "enqueue_by_class", spy)
    s, prio = run_sim(t, hw, prio=1)
    # the short ones (class 0) go before the long one (a later class); the first request,
    # already computing, is never preempted: every request meets its SLO
    assert prio["requests"] == 5 and round(prio["slo_attainment"] * 5) == 5
    assert s.tally.issued == s.tally.served and prio["dispatch"] == "immediate:prio=1"
    slo = s.cfg.slo
    assert sorted(c for _, _, c in seen) == [0, 0, 0, 3, 4]
    # the same requests get the same value from the live router's code
    for L, waited, cls in seen:
        assert _router_priority(L, waited, slo) == class_priority(cls)


def test_a_queued_order_with_prio_conserves_and_keys_on_the_slack_left(tmp_path, hw, monkeypatch):
    t = crafted_overload(tmp_path)
    seen: list[tuple[int, float, int]] = []

    def spy(waiting, j, cls):
        seen.append((j.L, j.qwait, cls))
        enqueue_by_class(waiting, j, cls)

    monkeypatch.setattr(engine, "enqueue_by_class", spy)
    s, m = run_sim(t, hw, "slack", max_queued_s=0.5, prio=1)
    assert s.tally.issued == s.tally.served == 5 and m["dispatch"] == "slack:T=0.5:prio=1"
    assert any(w > 0 for _, w, _ in seen)  # some were held: their class is from the slack left
    for L, waited, cls in seen:
        assert cls == priority_class(s.cfg.slo.ttft(L) - waited, s.cfg.slo)
        assert _router_priority(L, waited, s.cfg.slo) == class_priority(cls)


# -- the same instance order in the simulator and the emulated worker ------------------------
def _emulator_scheduler(low_first: bool = False) -> PrefillScheduler:
    return PrefillScheduler(
        16, 64, None, None, None, None, None,  # type: ignore[arg-type]  # the queue only
        priority_scheduling=True, low_priority_first=low_first,
    )  # fmt: skip


def _job(L: int) -> Job:
    """A job of ``L`` prompt tokens, nothing else of it read."""
    tr = types.SimpleNamespace(input_len=L, output_len=0)
    return Job(tr, None, (), None, None, None, 0.0, 0.0, False, None, True, 0, 0, 0.0, 0.0, L, 0.0)  # type: ignore[arg-type]


def _served_orders(events: list[tuple[str, int, int]]) -> tuple[list[int], list[int]]:
    """Replay arrivals (``("arrive", id, class)``) and services (``("serve", 0, 0)``: the
    instance takes the head of its queue) on a simulator instance's queue and on the
    emulator's; returns the ids in the order each served them."""
    sim_q: list[Job] = []
    emu = _emulator_scheduler()
    sim_out: list[int] = []
    emu_out: list[int] = []
    for kind, rid, cls in events:
        if kind == "arrive":
            j = _job(rid)
            enqueue_by_class(sim_q, j, cls)
            r = Req(rid=str(rid), tokens=[], params=GenParams())
            r.priority = class_priority(cls)  # what the router sends for that class
            emu._enqueue_by_priority(r)
        elif sim_q:
            sim_out.append(sim_q.pop(0).L)
            emu_out.append(int(emu.waiting.popleft().rid))
    while sim_q:
        sim_out.append(sim_q.pop(0).L)
        emu_out.append(int(emu.waiting.popleft().rid))
    return sim_out, emu_out


def test_simulator_and_emulator_order_the_same_arrivals_alike():
    rng = random.Random(11)
    for _ in range(200):
        events = []
        for rid in range(rng.randrange(1, 40)):
            events.append(("arrive", rid, rng.randrange(N_CLASSES)))
            if rng.random() < 0.4:
                events.append(("serve", 0, 0))
        sim_out, emu_out = _served_orders(events)
        assert sim_out == emu_out
    # by class, then by arrival within a class
    sim_out, _ = _served_orders([("arrive", i, c) for i, c in enumerate([3, 0, 3, 1, 0, 7])])
    assert sim_out == [1, 4, 3, 0, 2, 5]


def test_emulator_priority_as_sglang_defaults_and_direction():
    emu = _emulator_scheduler()
    for rid, p in (("none", None), ("low", -5), ("high", 9), ("mid", 0), ("high2", 9)):
        r = Req(rid=rid, tokens=[], params=GenParams())
        r.priority = p
        emu._enqueue_by_priority(r)
    # highest first; a request without a priority after every prioritised one
    assert [r.rid for r in emu.waiting] == ["high", "high2", "mid", "low", "none"]
    low = _emulator_scheduler(low_first=True)
    for rid, p in (("none", None), ("b", 5), ("a", 1)):
        r = Req(rid=rid, tokens=[], params=GenParams())
        r.priority = p
        low._enqueue_by_priority(r)
    assert [r.rid for r in low.waiting] == ["a", "b", "none"]
    fifo = PrefillScheduler(16, 64, None, None, None, None, None)  # type: ignore[arg-type]
    assert fifo.prio_sign is None


def test_request_priority_field_and_header(monkeypatch):
    assert request_priority({}) is None and request_priority({"priority": 3}) == 3
    for bad in ("3", 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            request_priority({"priority": bad})
    hdr = {"x-override-priority": "7"}
    monkeypatch.delenv("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", raising=False)
    assert request_priority({"priority": 1}, hdr) == 1  # SGLang ignores it without the switch
    monkeypatch.setenv("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "1")
    assert request_priority({"priority": 1}, hdr) == 7
    with pytest.raises(ValueError, match="x-override-priority"):
        request_priority({}, {"x-override-priority": "soon"})


def test_emulated_stack_workers_honour_the_routers_priorities():
    import copy

    from stack.launch import emulated
    from stack.launch.sglang import load_yaml
    from stack.paths import configs_dir

    base = load_yaml(configs_dir() / "local.yaml")
    for on in (True, False):
        cfg = copy.deepcopy(base)
        cfg.setdefault("router", {}).setdefault("dispatch", {})["sglang_priority"] = on
        specs = emulated.process_specs(cfg, emulated.plan(cfg), "/r.yaml")
        workers = [s for s in specs if s.role in ("prefill", "decode")]
        assert workers
        for s in workers:
            flags = " ".join(s.argv)
            assert ("--enable-priority-scheduling" in flags) is on
            assert ("--disable-priority-preemption" in flags) is on
            assert (s.env.get("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES") == "1") is on
