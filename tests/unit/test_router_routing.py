"""The routing step without HTTP: the pure view builder, choose -> book (one synchronous
booking of both workers), the one release, and the session id only for policies that ask."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from stack.core.cost_model import load_hardware
from stack.core.types import SLO
from stack.kv_tier.global_index import NoGlobalTier
from stack.kv_tier.index import PrefixIndex
from stack.policies import PolicyContext, make_policy
from stack.pool import LOAD_FRESH_S, WorkerRegistry
from stack.prefill_router.features import Features
from stack.prefill_router.routing import NoWorker, PrefillRouter
from stack.prefill_router.view import build_view

pytestmark = pytest.mark.timeout(30)


def _features(n: int = 1000, session: str | None = "s1") -> Features:
    return Features(np.zeros(n, dtype=np.int32), n, turn=2, est_hit=500, session_id=session)


def _router(policy: str, n_prefill: int = 2, n_decode: int = 1) -> PrefillRouter:
    cost = load_hardware("h20").cost
    reg = WorkerRegistry(eject_cooldown_s=0.0)
    index = PrefixIndex(16)
    for i in range(n_prefill):
        w = reg.add("prefill", f"http://p{i}:1", 9000 + i)
        index.add_worker(w.wid, events=False)
    for i in range(n_decode):
        reg.add("decode", f"http://d{i}:1")
    pol = make_policy(policy, PolicyContext(cost, SLO(), 16))
    return PrefillRouter(reg, index, NoGlobalTier(), pol, cost, 16, 0.0)


def test_build_view_is_a_pure_function_of_the_pool_figures():
    reg = WorkerRegistry()
    a = reg.add("prefill", "http://a:1")
    b = reg.add("prefill", "http://b:1")
    reg.charge(a, 1000, 0.5)
    b.polled_running, b.polled_waiting, b.polled_at = 1, 2, 100.0
    args = dict(prompt_tokens=1000, block_size=16, fetch_tokens_per_s=5e5, sec_per_token=1e-4)
    v = build_view(100.0 + LOAD_FRESH_S, [a, b], {b.wid: 3}, 4, **args)
    assert (v.now, v.global_hit, v.fetch_tokens_per_s, v.block_size) == (110.0, 64, 5e5, 16)
    sa, sb = v.instances
    assert (sa.index, sa.queued_tokens, sa.queued_seconds, sa.running, sa.local_hit) == (
        a.wid,
        1000,
        0.5,
        1,
        0,
    )
    assert (sb.index, sb.running, sb.local_hit, sb.decode_tokens) == (b.wid, 3, 48, 0)
    # the same figures give the same view; a poll older than the freshness window is ignored
    assert build_view(110.0, [a, b], {b.wid: 3}, 4, **args) == v
    assert build_view(110.1, [a, b], {b.wid: 3}, 4, **args).instances[1].running == 0


def test_route_returns_the_request_booked_on_prefill_and_decode():
    r = _router("smetric")

    async def go():
        return await r.route(_features(), set(), set(), True)

    routed = asyncio.run(go())
    pw, dw = routed.prefill, routed.decode
    assert pw.role == "prefill" and dw is not None and dw.role == "decode"
    assert routed.booking.prefill_ticket in pw.queued and pw.queued_tokens == 1000 and pw.inflight == 1
    assert dw.inflight == 1 and dw.queued_tokens == 0
    assert routed.booking.prefill_done() and not routed.booking.prefill_done()
    assert (pw.queued_tokens, pw.inflight) == (0, 1)
    routed.booking.release()
    routed.booking.release()  # one release, whatever the number of exit paths calling it
    assert (pw.inflight, dw.inflight) == (0, 0)


def test_no_worker_names_the_missing_role():
    r = _router("smetric", n_decode=0)
    r.registry.add("decode", "http://d:1").healthy = False
    with pytest.raises(NoWorker) as e:
        asyncio.run(r.route(_features(), set(), set(), True))
    assert e.value.role == "decode"
    assert all(not w.queued and w.inflight == 0 for w in r.registry.workers.values())  # nothing booked
    with pytest.raises(NoWorker) as e:
        asyncio.run(r.route(_features(), {0, 1}, set(), True))
    assert e.value.role == "prefill"


def test_session_id_reaches_only_policies_that_need_it():
    assert _router("session").request_of(_features()).session_id == "s1"
    assert _router("smetric").request_of(_features()).session_id is None
    r = _router("session")

    async def go(sid):
        routed = await r.route(_features(session=sid), set(), set(), False)
        routed.booking.release()
        return routed.prefill.wid

    first = asyncio.run(go("a"))
    r.registry.charge(r.registry.workers[first], 50_000, 5.0)  # make the other one idler
    assert asyncio.run(go("a")) == first  # the session policy still sticks to its instance
    assert asyncio.run(go("b")) != first
