"""`smetric replay`'s TTFT (stack/replay/driver.py) ends at the answer's first chunk, which SGLang
sends once the first token is made, even when the detokenizer holds that token's text back (an
incomplete UTF-8 character); the first chunk with visible text is kept beside it."""

from __future__ import annotations

import asyncio
import math

import httpx
import orjson
import pytest

from stack.replay.driver import Replay, ReplayConfig
from stack.sim.load import LoadSpec
from support.traces import linear_sessions

pytestmark = pytest.mark.timeout(60)

HELD_S = 0.3  # wall seconds between the role chunk and the first visible text


async def _stream():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    yield b"data: " + orjson.dumps(role) + b"\n\n"
    await asyncio.sleep(HELD_S)  # the next tokens complete the character
    text = {"choices": [{"index": 0, "delta": {"content": "\u00e9t\u00e9"}, "finish_reason": None}]}
    end = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    }
    for x in (text, end):
        yield b"data: " + orjson.dumps(x) + b"\n\n"
    yield b"data: [DONE]\n\n"


def test_ttft_ends_at_the_first_chunk_and_the_text_reading_is_kept(tmp_path):
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_stream())

    trace = linear_sessions(tmp_path / "t.jsonl", sessions=1, turns=1, first_blocks=4, growth=1, think=1.0)
    cfg = ReplayConfig(
        target="http://replay.test",
        trace=str(trace),
        load=LoadSpec(mode="compress", warmup=0.0, measure_until=math.inf),
        time_factor=1.0,
        request_timeout=10.0,
        model="m",
        metrics_url="",
        check_tokenizer=False,
        transport=httpx.MockTransport(handler),
    )
    rp = Replay(cfg)
    m = asyncio.run(rp.run())
    o = rp.outcomes[0]
    assert o.error is None
    assert o.ttft_wall < HELD_S / 2  # the role chunk: the first token was made
    assert o.ttft_text_wall >= o.ttft_wall + HELD_S * 0.9  # the text came with the next tokens
    assert m["ttft_p50"] == pytest.approx(o.ttft_wall)
    assert m["ttft_text_p50"] == pytest.approx(o.ttft_text_wall)
