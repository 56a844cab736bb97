"""Driver parity: the same cluster state through the live router's view builder and through
the simulator's gives the same InstanceState fields and the same Decision for every policy.

The two drivers fill a ClusterView from different sources (the router from its dispatch
accounting and the prefix index, the simulator from its instances and caches); a policy can
only be trusted in both if those views agree for the same state."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

import pytest

from stack.core.cost_model import load_hardware
from stack.core.types import SLO, Request
from stack.policies import POLICIES, PolicyContext, make_policy
from stack.pool import WorkerRegistry
from stack.prefill_router.view import build_view as live_view
from stack.sim.view import build_view as sim_view

BS = 64
HW = load_hardware("h20")
SPT = HW.cost.c_linear


@dataclass
class _Cache:
    blocks: int

    def hit(self, path) -> int:
        return self.blocks


@dataclass
class _Link:
    free_at: float


@dataclass
class _SimInstance:
    cache: _Cache
    q_tokens: int
    q_seconds: float
    n_jobs: int
    a_tokens: int
    link: _Link = field(default_factory=lambda: _Link(0.0))
    # PD: a prefill instance runs no decode (the colocated mode fills these)
    decode_running: int = 0
    decode_tokens: int = 0
    decode_step_s: float = 0.0


@dataclass
class _State:
    """One cluster state: per instance its queued jobs (tokens, seconds) and local hit."""

    jobs: list[list[tuple[int, float]]]
    local_blocks: list[int]
    global_blocks: int
    prompt_tokens: int
    turn: int
    est_hit: int


def _states(n: int, seed: int = 7) -> list[_State]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 6)
        L = rng.choice([1, 64, 500, 4_000, 30_000, 120_000])
        jobs = []
        for _ in range(k):
            js = []
            for _ in range(rng.randint(0, 4)):
                t = rng.randint(1, 60_000)
                js.append((t, HW.cost.cost(t, t)))
            jobs.append(js)
        # hits up to (and past) the whole prompt: both drivers cap them alike
        local = [rng.randint(0, L // BS + 2) if rng.random() < 0.6 else 0 for _ in range(k)]
        turn = rng.choice([1, 1, 2, 5])
        out.append(_State(jobs, local, rng.randint(0, L // BS + 2), L, turn, L // 2 if turn > 1 else 0))
    return out


def _live(state: _State, now: float):
    reg = WorkerRegistry(5.0)
    ws = [reg.add("prefill", f"http://127.0.0.1:{30000 + i}") for i in range(len(state.jobs))]
    for w, js in zip(ws, state.jobs):
        for t, s in js:
            reg.book(w, t, s, prompt_tokens=t + 100)
    hits = {w.wid: b for w, b in zip(ws, state.local_blocks) if b}
    view = live_view(
        now,
        ws,
        hits,
        state.global_blocks,
        prompt_tokens=state.prompt_tokens,
        block_size=BS,
        fetch_tokens_per_s=250_000.0,
        sec_per_token=SPT,
    )
    # live worker ids start at 0 in registration order, as the simulator's instance indices
    assert [s.index for s in view.instances] == list(range(len(ws)))
    return view


def _sim(state: _State, now: float, fetch_tps: float):
    insts = [
        _SimInstance(
            _Cache(b), sum(t for t, _ in js), sum(s for _, s in js), len(js), sum(t + 100 for t, _ in js)
        )
        for js, b in zip(state.jobs, state.local_blocks)
    ]
    path = (1,)  # any non-empty prefix: the stub caches answer by count
    return sim_view(now, insts, path, state.prompt_tokens, BS, _Cache(state.global_blocks), fetch_tps)


STATES = _states(60)


def _assert_instances_agree(live: list, sim: list) -> None:
    """The two drivers' instance states, field by field: integers and flags exactly, floats to
    pytest.approx's relative tolerance (approx over flat numbers only, so any pytest 8 or 9 takes it)."""
    assert len(live) == len(sim)
    for i, (a, b) in enumerate(zip(live, sim)):
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, float) or isinstance(y, float):
                assert x == pytest.approx(y), (i, f.name, x, y)
            else:
                assert x == y, (i, f.name, x, y)


def test_views_agree_field_by_field():
    for st in STATES:
        lv = _live(st, now=100.0)
        sv = _sim(st, now=100.0, fetch_tps=lv.fetch_tokens_per_s)
        _assert_instances_agree(lv.instances, sv.instances)
        assert (lv.global_hit, lv.fetch_tokens_per_s, lv.block_size) == (
            sv.global_hit,
            sv.fetch_tokens_per_s,
            sv.block_size,
        )
        # the rule both apply: never the whole prompt (its last token yields the first output)
        assert all(i.local_hit <= max(0, st.prompt_tokens - 1) for i in lv.instances)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_decides_alike_on_both_views(name):
    ctx = PolicyContext(HW.cost, SLO(), BS)
    live_policy, sim_policy = make_policy(name, ctx), make_policy(name, ctx)
    for i, st in enumerate(STATES):
        lv = _live(st, now=100.0 + i)
        sv = _sim(st, now=100.0 + i, fetch_tps=lv.fetch_tokens_per_s)
        sid = f"s{i % 5}" if live_policy.needs_session_id else None
        req = Request(st.prompt_tokens, st.turn, st.est_hit, sid)
        d_live, d_sim = live_policy.choose(req, lv), sim_policy.choose(req, sv)
        assert d_live == d_sim, (name, i, st)
        fb_live = live_policy.feedback(req, lv.instances[d_live.instance])
        fb_sim = sim_policy.feedback(req, sv.instances[d_sim.instance])
        assert fb_live == fb_sim


def _decodes(state: _State, seed: int) -> list[list[int]]:
    """Per instance, the contexts of the requests it decodes (PD colocation)."""
    rng = random.Random(seed)
    return [[rng.randint(100, 120_000) for _ in range(rng.randint(0, 3))] for _ in state.jobs]


def _live_colocated(state: _State, decodes: list[list[int]], now: float):
    reg = WorkerRegistry(5.0)
    ws = [reg.add("prefill", f"http://127.0.0.1:{30000 + i}") for i in range(len(state.jobs))]
    for w, ctxs in zip(ws, decodes):
        for c in ctxs:  # prefill done, answer not ended: decoding on the same worker
            assert reg.book(w, c, 0.1, prompt_tokens=c).prefill_done()
    for w, js in zip(ws, state.jobs):
        for t, s in js:
            reg.book(w, t, s, prompt_tokens=t + 100)
    hits = {w.wid: b for w, b in zip(ws, state.local_blocks) if b}
    return live_view(
        now,
        ws,
        hits,
        state.global_blocks,
        prompt_tokens=state.prompt_tokens,
        block_size=BS,
        fetch_tokens_per_s=250_000.0,
        sec_per_token=SPT,
        decode=HW.decode,
    )


def _sim_colocated(state: _State, decodes: list[list[int]], now: float, fetch_tps: float):
    insts = []
    for js, b, ctxs in zip(state.jobs, state.local_blocks, decodes):
        B, C = len(ctxs), sum(ctxs)
        insts.append(
            _SimInstance(
                _Cache(b),
                sum(t for t, _ in js),
                sum(s for _, s in js),
                len(js),
                sum(t + 100 for t, _ in js),
                decode_running=B,
                decode_tokens=C,
                decode_step_s=HW.decode.mixed_extra(B, C, SPT) if B else 0.0,
            )
        )
    return sim_view(now, insts, (1,), state.prompt_tokens, BS, _Cache(state.global_blocks), fetch_tps)


@pytest.mark.parametrize("name", ["smetric", "smetric-global", "lmetric", "least-load", "linear"])
def test_colocated_views_and_decisions_agree(name):
    ctx = PolicyContext(HW.cost, SLO(), BS, colocated=True, chunk_tokens=HW.chunk_tokens)
    live_policy, sim_policy = make_policy(name, ctx), make_policy(name, ctx)
    for i, st in enumerate(STATES):
        dec = _decodes(st, seed=i)
        lv = _live_colocated(st, dec, now=100.0 + i)
        sv = _sim_colocated(st, dec, now=100.0 + i, fetch_tps=lv.fetch_tokens_per_s)
        _assert_instances_agree(lv.instances, sv.instances)
        req = Request(st.prompt_tokens, st.turn, st.est_hit, None)
        assert live_policy.choose(req, lv) == sim_policy.choose(req, sv), (name, i)
