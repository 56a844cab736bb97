"""Decode side: PD body construction, rooms, decode choice, failure handling of the hand-off."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from stack.decode_router.bodies import RoomAllocator, batch_size, pd_body
from stack.decode_router.decode_choice import pick_decode
from stack.decode_router.handoff import HandOff, PDForwarder
from stack.decode_router.upstream import UpstreamError, make_session
from stack.pool import Worker, WorkerRegistry, parse_loads

pytestmark = pytest.mark.timeout(30)


def _pw():
    return Worker(0, "prefill", "http://10.1.2.3:30000", bootstrap_port=8998)


def test_pd_body_splices_fields_into_raw_json():
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    raw = orjson.dumps(body) + b"  \n"
    data, room, rid = pd_body(raw, body, _pw(), RoomAllocator())
    out = orjson.loads(data)
    assert out["messages"] == body["messages"] and out["stream"] is True
    assert out["bootstrap_host"] == "10.1.2.3" and out["bootstrap_port"] == 8998
    assert out["bootstrap_room"] == room and 0 <= room < 2**63
    assert out["rid"] == rid


def test_pd_body_client_bootstrap_fields_are_overridden_and_rid_kept():
    body = {"text": "x", "bootstrap_room": 5, "rid": "mine"}
    data, room, rid = pd_body(orjson.dumps(body), body, _pw(), RoomAllocator())
    out = orjson.loads(data)
    assert out["bootstrap_room"] == room != 5 and rid == "mine" and out["rid"] == "mine"
    assert data.count(b"bootstrap_room") == 1


def test_pd_body_batches_get_lists():
    body = {"text": ["a", "b", "c"]}
    assert batch_size(body) == 3 and batch_size({"input_ids": [[1], [2]]}) == 2
    assert batch_size({"input_ids": [1, 2]}) is None and batch_size({"prompt": "x"}) is None
    out = orjson.loads(pd_body(orjson.dumps(body), body, _pw(), RoomAllocator())[0])
    assert out["bootstrap_host"] == ["10.1.2.3"] * 3 and out["bootstrap_port"] == [8998] * 3
    assert len(set(out["bootstrap_room"])) == 3 and len(out["rid"]) == 3


def test_pd_body_colocated_only_adds_rid():
    body = {"prompt": "x"}
    out = orjson.loads(pd_body(orjson.dumps(body), body, None, RoomAllocator())[0])
    assert set(out) == {"prompt", "rid"}


def test_rooms_unique():
    ra = RoomAllocator()
    rooms = [ra.new() for _ in range(20000)]
    assert len(set(rooms)) == len(rooms)


def test_pick_decode_least_loaded():
    reg = WorkerRegistry()
    a = reg.add("decode", "http://a:1")
    b = reg.add("decode", "http://b:1")
    reg.charge(a, 0, 0.0)
    assert pick_decode([a, b]) is b
    reg.charge(b, 0, 0.0)
    reg.charge(b, 0, 0.0)
    assert pick_decode([a, b]) is a
    a.healthy = False
    assert pick_decode([a, b]) is b
    assert pick_decode([a, b], exclude={b.wid}) is None


def test_parse_loads_shapes():
    assert parse_loads(
        {"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.5}] * 2}
    ) == (4, 2, 0.5)
    assert parse_loads({"load": 7}) == (7, 0, 0.0)
    assert parse_loads({"what": 1}) is None
    assert parse_loads({"load": "x"}) is None


class _App:
    """A tiny ASGI worker whose POST behaviour is a coroutine ``handler(path, body, send)``."""

    def __init__(self, handler):
        self.handler = handler
        self.aborts = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] == "/abort_request":
            self.aborts.append(orjson.loads(body)["rid"])
            await _send(send, 200, b"{}")
            return
        await self.handler(scope["path"], body, send)


async def _send(send, status, data, ctype=b"application/json"):
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": data})


def _serve(app):
    from stack.worker.fake import ServerThread

    return ServerThread(app, lifespan="off").start()


def test_prefill_failure_mid_stream_aborts_decode_and_ends_with_error():
    import threading

    fail_now = threading.Event()

    async def prefill(path, body, send):
        while not fail_now.is_set():
            await asyncio.sleep(0.01)
        await _send(send, 500, b'{"error": "boom"}')

    async def decode(path, body, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b'data: {"a": 1}\n\n', "more_body": True})
        await asyncio.sleep(5)  # waits for KV that never comes
        await send({"type": "http.response.body", "body": b"data: never\n\n"})

    pa, da = _App(prefill), _App(decode)
    ps, ds = _serve(pa), _serve(da)

    async def run():
        async with make_session() as session:
            fwd = PDForwarder(session)
            p = Worker(0, "prefill", ps.url, bootstrap_port=1)
            d = Worker(1, "decode", ds.url)
            body = {"messages": [], "stream": True}
            up = await fwd.forward(
                HandOff("/v1/chat/completions", orjson.dumps(body), body, p, d, lambda: None)
            )
            assert up.first.startswith(b"data: ")
            fail_now.set()
            return [c async for c in up.rest]

    try:
        rest = asyncio.run(asyncio.wait_for(run(), 10))
        assert len(rest) == 1 and b"prefill worker failed" in rest[0]
        assert rest[0].endswith(b"data: [DONE]\n\n")  # as SGLang ends a failed stream
        assert len(da.aborts) == 1
    finally:
        ps.stop()
        ds.stop()


def test_decode_4xx_is_not_retryable_and_aborts_prefill():
    async def prefill(path, body, send):
        await asyncio.sleep(0.2)
        await _send(send, 200, b"{}")

    async def decode(path, body, send):
        await _send(send, 400, b'{"error": {"message": "bad"}}')

    pa, da = _App(prefill), _App(decode)
    ps, ds = _serve(pa), _serve(da)

    async def run():
        async with make_session() as session:
            fwd = PDForwarder(session)
            p = Worker(0, "prefill", ps.url, bootstrap_port=1)
            d = Worker(1, "decode", ds.url)
            body = {"text": "x"}
            with pytest.raises(UpstreamError) as e:
                await fwd.forward(HandOff("/generate", orjson.dumps(body), body, p, d, lambda: None))
            return e.value

    try:
        err = asyncio.run(asyncio.wait_for(run(), 10))
        assert err.status == 400 and not err.retryable and err.role == "decode"
        assert b"bad" in err.body
        assert len(pa.aborts) == 1
    finally:
        ps.stop()
        ds.stop()


def test_fake_decode_waits_for_its_prefill_over_the_kv_link():
    """The emulated PD pair: decode answers only after prefill finished the same room; a
    prefill that fails leaves decode waiting until the router aborts it, so the forwarder
    reports the prefill failure (retryable) instead of passing decode's answer on."""
    from stack.worker.fake import FakeWorker, KVLink

    link = KVLink(timeout_s=5)
    good_p = FakeWorker(mode="prefill", name="p", prefill_delay_s=0.2, link=link)
    bad_p = FakeWorker(mode="prefill", name="bad", fail="500", link=link)
    dw = FakeWorker(mode="decode", name="d", tokens=2, link=link)
    servers = [_serve(w) for w in (good_p, bad_p, dw)]
    gs, bs, ds = servers

    async def run():
        async with make_session() as session:
            fwd = PDForwarder(session)
            d = Worker(2, "decode", ds.url)

            def send(body: dict, prefill_url: str):
                p = Worker(0 if prefill_url == gs.url else 1, "prefill", prefill_url, bootstrap_port=1)
                return fwd.forward(
                    HandOff(
                        "/v1/chat/completions", orjson.dumps(body), body, p, d, lambda: None, stream=False
                    )
                )

            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            t0 = asyncio.get_running_loop().time()
            up = await send(body, gs.url)
            waited = asyncio.get_running_loop().time() - t0
            with pytest.raises(UpstreamError) as e:
                await send(body, bs.url)
            # whatever JSON a client sent as its rid
            assert (await send(dict(body, rid={"not": "a string"}), gs.url)).status == 200
            return up, waited, e.value

    try:
        up, waited, err = asyncio.run(asyncio.wait_for(run(), 10))
        assert up.status == 200 and orjson.loads(up.first)["choices"]
        assert waited >= 0.2  # decode's answer came after prefill's delay
        assert err.role == "prefill" and err.retryable
        assert len(dw.aborts) == 1 and len(dw.records) == 3
    finally:
        for s in servers:
            s.stop()


def _sse_app(events: list[bytes], prefill_delay_s: float = 5.0):
    """A prefill worker that answers after ``prefill_delay_s`` and a decode worker that streams
    ``events`` (one chunk each)."""

    async def prefill(path, body, send):
        await asyncio.sleep(prefill_delay_s)
        await _send(send, 200, b"{}")

    async def decode(path, body, send):
        hdr = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": hdr})
        for i, e in enumerate(events):
            await send({"type": "http.response.body", "body": e, "more_body": i < len(events) - 1})
            await asyncio.sleep(0.01)

    return _App(prefill), _App(decode)


_ERR = b'data: {"error": {"object": "error", "message": "bootstrap timeout", "code": 500}}\n\n'


def test_error_before_the_first_token_is_a_retryable_pair_failure():
    """Decode gives up on its prefill twin (SGLang streams an error event, then [DONE]) before
    any token: nothing has reached the client, so the forwarder raises a retryable failure of
    the pair (counted against the prefill worker, :meth:`Routed.failed`) and aborts prefill."""
    pa, da = _sse_app([_ERR[:20], _ERR[20:], b"data: [DONE]\n\n"])
    ps, ds = _serve(pa), _serve(da)

    async def run():
        async with make_session() as session:
            fwd = PDForwarder(session)
            p = Worker(0, "prefill", ps.url, bootstrap_port=1)
            d = Worker(1, "decode", ds.url)
            body = {"messages": [], "stream": True}
            with pytest.raises(UpstreamError) as e:
                await fwd.forward(
                    HandOff("/v1/chat/completions", orjson.dumps(body), body, p, d, lambda: None, stream=True)
                )
            return e.value

    try:
        err = asyncio.run(asyncio.wait_for(run(), 10))
        assert err.retryable and err.pair and err.role == "decode" and err.status == 500
        assert "bootstrap timeout" in err.message
        assert len(pa.aborts) == 1
    finally:
        ps.stop()
        ds.stop()


def test_error_after_the_first_token_reaches_the_client_and_is_counted():
    tok = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
    pa, da = _sse_app([tok, _ERR, b"data: [DONE]\n\n"], prefill_delay_s=0.0)
    ps, ds = _serve(pa), _serve(da)

    class _Count:
        n = 0

        def inc(self):
            self.n += 1

    async def run():
        async with make_session() as session:
            count = _Count()
            fwd = PDForwarder(session, stream_errors=count)
            p = Worker(0, "prefill", ps.url, bootstrap_port=1)
            d = Worker(1, "decode", ds.url)
            body = {"messages": [], "stream": True}
            up = await fwd.forward(
                HandOff("/v1/chat/completions", orjson.dumps(body), body, p, d, lambda: None, stream=True)
            )
            rest = b"".join([c async for c in up.rest])
            return up.first, rest, count.n

    try:
        first, rest, n = asyncio.run(asyncio.wait_for(run(), 10))
        assert first == tok and rest == _ERR + b"data: [DONE]\n\n" and n == 1
    finally:
        ps.stop()
        ds.stop()


def test_failure_of_reads_each_apis_error_event():
    from stack.decode_router.sse import failure_of

    assert failure_of({"error": {"message": "m", "code": 500}}) == (500, "m")
    assert failure_of({"type": "error", "error": {"type": "api_error", "message": "m"}}) == (500, "m")
    abort = {
        "text": "",
        "meta_info": {"finish_reason": {"type": "abort", "message": "t", "status_code": 503}},
    }
    assert failure_of(abort) == (503, "t")
    graceful = {"meta_info": {"finish_reason": {"type": "abort", "message": "aborted", "status_code": None}}}
    assert failure_of(graceful) is None  # the client's own abort
    assert failure_of({"choices": [{"delta": {"content": "error"}}]}) is None
    assert failure_of([1]) is None
