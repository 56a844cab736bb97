"""The client clock of a streamed decode: frames are timed by the read that brought them, so a
reader that stalls and then gets many frames at once counts the stall once, not as many
near-zero gaps (what made a CI run read a TPOT 300x short)."""

from __future__ import annotations

import time

import httpx
import orjson

from stack.calibrate.measure import Meter
from stack.calibrate.target import Target

STEP = 0.01


def _frame(n: int) -> bytes:
    return b"data: " + orjson.dumps({"text": "x", "meta_info": {"completion_tokens": n}}) + b"\n\n"


class _Stream(httpx.SyncByteStream):
    """Frames 1..4 one per read, STEP apart; then frames 5..16 held for as long as a stalled
    reader would hold them and delivered in one read; then [DONE]."""

    def __iter__(self):
        for n in range(1, 5):
            yield _frame(n)
            time.sleep(STEP)
        time.sleep(11 * STEP)
        yield b"".join(_frame(n) for n in range(5, 17))
        yield b"data: [DONE]\n\n"


def _meter(handler) -> Meter:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    t = Target("http://w", "emulator", "null", "m", "/generate", False, client_clock="stream")
    return Meter(client, t)


def test_a_burst_after_a_stall_is_one_sample_not_many_zero_gaps():
    m = _meter(lambda req: httpx.Response(200, stream=_Stream()))
    d = m.decode(list(range(100, 164)), 16)
    assert d.steps == 15
    # the stall of 12 frames is one sample of (11 + 1) steps over 12 tokens: about STEP
    assert 0.5 * STEP < d.step_s < 3 * STEP


def test_every_frame_in_its_own_read_is_timed_as_it_came():
    class Paced(httpx.SyncByteStream):
        def __iter__(self):
            for n in range(1, 9):
                yield _frame(n)
                time.sleep(STEP)
            yield b"data: [DONE]\n\n"

    d = _meter(lambda req: httpx.Response(200, stream=Paced())).decode(list(range(100, 164)), 8)
    assert d.steps == 7
    assert 0.8 * STEP < d.step_s < 3 * STEP
