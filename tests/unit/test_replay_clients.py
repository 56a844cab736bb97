"""`smetric replay`'s client model (stack/replay/driver.py with a ClientModel): attempts that get
an overload answer or no first token within the client's patience are retried as the SDKs do,
TTFT counts from the first attempt, and a request out of retries fails its agent stream."""

from __future__ import annotations

import asyncio
import math

import httpx
import orjson
import pytest

from stack.replay.driver import Replay, ReplayConfig, _retriable
from stack.sim.clients import ClientModel
from stack.sim.load import LoadSpec
from support.traces import linear_sessions

TF = 0.1  # wall seconds per modelled second

pytestmark = pytest.mark.timeout(60)


def _sse(text: str = "hi") -> bytes:
    chunk = {"choices": [{"delta": {"content": text}, "finish_reason": None}]}
    end = {
        "choices": [{"delta": {}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }
    return b"".join(b"data: " + orjson.dumps(x) + b"\n\n" for x in (chunk, end)) + b"data: [DONE]\n\n"


def _replay(tmp_path, handler, clients: ClientModel | None) -> tuple[Replay, dict]:
    trace = linear_sessions(tmp_path / "t.jsonl", sessions=1, turns=2, first_blocks=4, growth=1, think=1.0)
    cfg = ReplayConfig(
        target="http://replay.test",
        trace=str(trace),
        load=LoadSpec(mode="compress", warmup=0.0, measure_until=math.inf),
        time_factor=TF,
        request_timeout=10.0,
        model="m",
        metrics_url="",
        check_tokenizer=False,
        transport=httpx.MockTransport(handler),
        clients=clients,
    )
    rp = Replay(cfg)
    return rp, asyncio.run(rp.run())


def test_refused_and_stalled_attempts_are_retried_and_timed_from_the_first(tmp_path):
    calls: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(asyncio.get_running_loop().time())
        if len(calls) == 1:  # overloaded: come back in 1 wall second (10 modelled)
            return httpx.Response(503, headers={"retry-after": "1"}, json={"error": {"code": "overloaded"}})
        if len(calls) == 2:  # nothing before the client's patience (2 modelled s = 0.2 wall s)
            await asyncio.sleep(5.0)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse())

    rp, m = _replay(tmp_path, handler, ClientModel(patience_s=2.0, max_retries=2))
    first = rp.outcomes[0]
    assert first.error is None and first.attempts == 3 and first.refusals == 1 and first.timeouts == 1
    assert calls[1] - calls[0] >= 0.95  # the Retry-After was honoured
    # TTFT counts from the first attempt: the refusal's wait and the abandoned attempt's
    assert first.ttft_wall >= 1.0 + 0.2
    assert len(calls) == 4  # the stream went on: its second turn, at the first attempt
    assert (m["attempts"], m["retries"], m["refusals"], m["timeouts"], m["failed_after_retries"]) == (
        4,
        2,
        1,
        1,
        0,
    )
    assert m["ttft_max"] >= (1.0 + 0.2) / TF


def test_a_request_out_of_retries_fails_and_ends_its_stream(tmp_path):
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(529, json={"type": "error", "error": {"type": "overloaded_error"}})

    rp, m = _replay(tmp_path, handler, ClientModel(max_retries=2, backoff_s=0.1, backoff_max_s=0.2))
    assert len(calls) == 3  # the first attempt and two retries; the second turn never sent
    assert rp.outcomes[0].error.startswith("http_529") and len(rp.outcomes) == 1
    assert m["failed_after_retries"] == 1 and m["failed_share"] == 1.0 and m["refusals"] == 3


def test_without_a_client_model_one_attempt_each(tmp_path):
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503, headers={"retry-after": "1"}, json={"error": {}})

    rp, m = _replay(tmp_path, handler, None)
    assert len(calls) == 1 and "attempts" not in m and rp.outcomes[0].error.startswith("http_503")


def test_what_the_sdks_retry():
    for e in ("http_429: x", "http_503: x", "http_529: x", "http_408: x", "timeout: x", "transport: x"):
        assert _retriable(e), e
    for e in ("http_400: x", "http_401: x", "http_404: x", "abort: x", "stream_error: x", "cancelled: x"):
        assert not _retriable(e), e
