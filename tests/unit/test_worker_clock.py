"""The emulator's modelled clock: host work (in its own event loop, or CPU hogs beside it) does
not stretch the modelled TTFT it accounts, and falling behind the clock is counted and warned.

Asserts on the engine's own accounting (``ttft_model_s``, the clock's stats), not on wall speed.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import random
import time

import pytest

from stack.worker.clock import ModelClock
from stack.worker.engine import Engine, GenParams
from stack.worker.request_path import Worker
from stack.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(120)

L = 32_768  # 4 chunks of 8192 on the h20 calibration
TF = 0.01  # ~47 ms wall for the whole prefill: 6-18 ms per step
#: generous bound: the modelled TTFT of an idle engine is its cost-model time within 20%
BOUND = 0.20


def _expected(e: Engine) -> float:
    c, ck = e.cost, e.chunk_tokens
    done, tot = 0, 0.0
    while done < L:
        n = min(ck, L - done)
        tot += c.c_fwd + c.chunk(n, done + n)
        done += n
    return tot


def _spin(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x += 1


async def _loop_hog(stop: asyncio.Event, slice_s: float) -> None:
    """The emulator's own host work: blocking CPU slices on its event loop."""
    while not stop.is_set():
        _spin(time.monotonic() + slice_s)
        await asyncio.sleep(0)


async def _ttfts(hog_slice_s: float | None, n: int = 3) -> tuple[list[float], float, dict]:
    w = Worker(WorkerSettings(mode="prefill", time_factor=TF, kv_transport="http", name="clock-test"))
    e = w.engine
    await e.start()
    stop = asyncio.Event()
    hog = asyncio.create_task(_loop_hog(stop, hog_slice_s)) if hog_slice_s else None
    out = []
    try:
        rng = random.Random(1)
        for _ in range(n):
            tokens = [rng.randrange(150_000) for _ in range(L)]  # no prefix hits
            req = w.make_req(tokens, GenParams(max_new_tokens=1))
            await e.scheduler.prefill(req)
            out.append(e.scheduler.meta(req, w.s.name)["ttft_model_s"])
    finally:
        stop.set()
        if hog is not None:
            await hog
        await e.stop()
    return out, _expected(e), e.clock.stats.as_dict()


def test_modelled_ttft_without_host_load():
    got, want, _ = asyncio.run(_ttfts(None))
    for t in got:
        assert abs(t - want) <= BOUND * want, (t, want)


def test_modelled_ttft_with_host_work_in_the_loop():
    # 8 ms blocking slices on the engine's own loop: a sleep-after-work engine would add up to
    # a slice to each of the 4 steps (~+30-60% of the 47 ms prefill)
    got, want, stats = asyncio.run(_ttfts(0.008))
    for t in got:
        assert abs(t - want) <= BOUND * want, (t, want, stats)
    assert stats["resyncs"] == 0


def test_modelled_ttft_with_cpu_hogs_beside_it():
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=_spin, args=(time.monotonic() + 60,), daemon=True) for _ in range(3)]
    for h in hogs:
        h.start()
    try:
        got, want, stats = asyncio.run(_ttfts(0.004))
    finally:
        for h in hogs:
            h.terminate()
            h.join()
    for t in got:
        assert abs(t - want) <= BOUND * want, (t, want, stats)


def test_clock_counts_lag_and_warns_when_behind(caplog):
    c = ModelClock(time_factor=0.1, late_s=0.005, resync_s=0.25, name="w0")
    d1 = c.step(1.0, runnable_at=10.0, now=10.0)  # idle start: deadline = runnable + 0.1
    assert d1 == pytest.approx(10.1)
    d2 = c.step(1.0, runnable_at=10.05, now=10.12)  # 20 ms late: absorbed, back to back
    assert d2 == pytest.approx(10.2)
    assert c.stats.late_steps == 1 and c.stats.resyncs == 0
    with caplog.at_level(logging.WARNING, logger="stack.worker"):
        d3 = c.step(1.0, runnable_at=10.2, now=11.0)  # 0.8 s behind: the model is stretched
    assert d3 == pytest.approx(11.1)
    assert c.stats.resyncs == 1 and c.stats.lost_wall_s == pytest.approx(0.8)
    assert any("fell behind its modelled clock" in r.message for r in caplog.records)
    d4 = c.step(2.0, runnable_at=20.0, now=20.001)  # after an idle spell: from runnable_at
    assert d4 == pytest.approx(20.2)
