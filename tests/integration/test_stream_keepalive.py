"""Keep-alives for a streamed request whose first token is slow (stack/prefill_router/api/
keepalive.py): behind a real haproxy whose idle timeout (1 s) is shorter than the prefill
(2.5 s), a streamed call through the official OpenAI and Anthropic SDKs completes with the
router's keep-alives and is cut without them; a failure after the keep-alives started ends
the stream with an error event in the API's shape; a client that leaves during them frees
both workers; a request the queue refuses still gets its overload status."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from stack.models.tiny import build_tiny_model
from support.haproxy import HAProxy
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)

PREFILL_S = 2.5
KEEPALIVE_S = 0.3
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _cluster(model_dir, keepalive_s: float | None, **kw) -> Cluster:
    return Cluster(
        model_dir,
        n_prefill=1,
        n_decode=1,
        prefill_kw={"prefill_delay_s": PREFILL_S, "agent_paths": True},
        decode_kw={"agent_paths": True, "tokens": 6},
        router={"stream_keepalive_s": keepalive_s, "health_timeout_s": 5.0, **kw},
    )


@pytest.fixture(scope="module")
def kept(model_dir, tmp_path_factory):
    c = _cluster(model_dir, KEEPALIVE_S)
    px = HAProxy([c.url], tmp_path_factory.mktemp("px"), idle_s=1.0)
    yield c, px
    px.close()
    c.close()


@pytest.fixture(scope="module")
def bare(model_dir, tmp_path_factory):
    c = _cluster(model_dir, None)
    px = HAProxy([c.url], tmp_path_factory.mktemp("px"), idle_s=1.0)
    yield c, px
    px.close()
    c.close()


def _running(c: Cluster) -> int:
    """Requests the router has booked on its workers and not released."""
    return sum(w.view_running(-1.0, time.monotonic()) for w in c.state.registry.workers.values())


def _openai(url: str) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as oa:
        stream = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


def _anthropic(url: str) -> str:
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=30) as an:
        with an.messages.stream(model="tiny", max_tokens=6, messages=MSG) as s:
            return "".join(s.text_stream)


def test_a_slow_first_token_survives_the_proxy_with_keep_alives(kept):
    c, px = kept
    t0 = time.monotonic()
    direct = _openai(c.url)
    assert direct and time.monotonic() - t0 >= PREFILL_S  # the prefill outlasts the proxy's 1 s
    assert _openai(px.url) == direct
    assert _anthropic(px.url) == _anthropic(c.url) == "t0 t1 t2 t3 t4 t5 "
    # on the wire: 200, then comment lines, then the answer's events
    with httpx.stream(
        "POST",
        f"{px.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MSG, "max_tokens": 6, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    first_data = next(i for i, x in enumerate(lines) if x.startswith("data:"))
    assert first_data >= 3 and all(x == ": keep-alive" for x in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    assert _running(c) == 0  # every booking released


def test_without_keep_alives_the_proxy_cuts_the_same_call(bare):
    c, px = bare
    assert _openai(c.url)  # direct, the answer comes
    with pytest.raises(openai.APIStatusError) as ei:
        _openai(px.url)
    assert ei.value.status_code == 504  # haproxy's server timeout
    with pytest.raises(anthropic.APIStatusError):
        _anthropic(px.url)


def test_a_failure_after_keep_alives_ends_the_stream_with_an_error_event(model_dir):
    """The only prefill worker answers 500 after its delay: the router's retry finds no other
    worker, and the client, already answered 200, gets the error as an event."""
    c = Cluster(
        model_dir,
        n_prefill=1,
        n_decode=1,
        prefill_kw={"fail": "500", "fail_delay_s": 1.0},
        router={"stream_keepalive_s": KEEPALIVE_S, "health_timeout_s": 5.0},
    )
    try:
        with c.client.stream(
            "POST", "/v1/chat/completions", json={"model": "tiny", "messages": MSG, "stream": True}
        ) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x]
        assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and lines[-2].startswith("data: ")
        with pytest.raises(openai.APIError):
            _openai(c.url)
        # a non-streamed request is answered with the status, as before
        r = c.client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG})
        assert r.status_code >= 500
    finally:
        c.close()


def test_a_client_that_leaves_during_keep_alives_frees_both_workers(kept):
    c, _ = kept
    p, d = c.prefill[0], c.decode[0]
    aborts = (len(p.aborts), len(d.aborts))
    with httpx.stream(
        "POST",
        f"{c.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MSG, "max_tokens": 6, "stream": True},
        timeout=30,
    ) as r:
        it = r.iter_lines()
        assert next(it) == ": keep-alive"
    # the connection is closed mid-prefill: the router aborts the request on both workers
    t0 = time.monotonic()
    # (both aborts go out one after the other: wait for each, not for the first)
    while len(p.aborts) == aborts[0] or len(d.aborts) == aborts[1] or _running(c):
        assert time.monotonic() - t0 < 10, (p.aborts, d.aborts)
        time.sleep(0.05)
    assert len(p.aborts) > aborts[0] and len(d.aborts) > aborts[1]
