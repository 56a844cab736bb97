"""The emulated engine's parts, pure pieces: a step's batch of chunks, the global tier's leading
run of present pages, the planned output and its paced stream."""

from __future__ import annotations

import asyncio

import pytest

from stack.worker.global_tier import leading_run
from stack.worker.output import EOS_TOKEN_ID, pace_tokens, plan_output
from stack.worker.request import GenParams, Req
from stack.worker.scheduler import take_chunks

pytestmark = pytest.mark.timeout(30)


def _req(rid: str, L: int, done: int = 0, **params) -> Req:
    r = Req(rid=rid, tokens=list(range(1, L + 1)), params=GenParams(**params))
    r.done_tokens = done
    return r


def test_take_chunks_fills_the_budget_fifo():
    a, b, c = _req("a", 100, done=40), _req("b", 50), _req("c", 30)
    batch = take_chunks([a, b, c], 80)
    assert [(r.rid, n, end) for r, n, end in batch] == [("a", 60, 100), ("b", 20, 20)]


def test_take_chunks_skips_finished_and_stops_at_zero_budget():
    done, a = _req("done", 10, done=10), _req("a", 10)
    assert [(r.rid, n, end) for r, n, end in take_chunks([done, a], 4)] == [("a", 4, 4)]
    assert take_chunks([a], 0) == []


def test_leading_run_stops_at_the_first_missing_page():
    assert leading_run([]) == 0
    assert leading_run([False, True]) == 0
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([True] * 3) == 3


def test_plan_output_is_deterministic_and_bounded():
    r = _req("a", 64)
    out1, fin1 = plan_output(r, 64)
    out2, fin2 = plan_output(r, 64)
    assert out1 == out2 and fin1 == fin2
    assert 8 <= len(out1) <= 64
    assert fin1 == {"type": "stop", "matched": EOS_TOKEN_ID}


def test_plan_output_length_and_ignore_eos():
    out, fin = plan_output(_req("a", 64, max_new_tokens=3), 64)
    assert len(out) == 3 and fin == {"type": "length", "length": 3}
    out, fin = plan_output(_req("a", 64, max_new_tokens=500, ignore_eos=True), 64)
    assert len(out) == 500 and fin == {"type": "length", "length": 500}


def test_plan_output_cuts_at_a_stop_string():
    r = _req("a", 64, ignore_eos=True, max_new_tokens=40)
    full, _ = plan_output(r, 64)
    text = "".join(p for _, p in full)
    stop = text[10:14]
    r.params.stop = [stop]
    out, fin = plan_output(r, 64)
    assert fin == {"type": "stop", "matched": stop}
    got = "".join(p for _, p in out)
    assert got == text[: text.index(stop)]


def test_pace_tokens_yields_every_index():
    async def run() -> list[int]:
        return [i async for i in pace_tokens(5, 0.0)]

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_pace_tokens_resume_after_a_stall_without_a_burst():
    """A stall of 0.2 s after the first token: the next tokens keep the pace from then on
    instead of coming out at once to catch up."""
    import time

    async def run():
        times = []
        async for i in pace_tokens(4, 0.05):
            times.append(time.monotonic())
            if i == 0:
                time.sleep(0.2)  # the event loop blocked
        return times

    t = asyncio.run(run())
    gaps = [b - a for a, b in zip(t[1:], t[2:], strict=False)]
    assert all(g >= 0.04 for g in gaps), gaps
