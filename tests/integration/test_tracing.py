"""OpenTelemetry tracing (router.tracing): the router's spans and their parent/child links, the
W3C traceparent each PD worker gets, a client's trace continued, sampling, tracing off, OTLP
export, and the emulated worker's span continuing the router's trace."""

from __future__ import annotations

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from stack.config import parse_config
from stack.models.tiny import build_tiny_model
from stack.worker.fake import ServerThread
from stack.worker.http.app import build_app
from stack.worker.settings import WorkerSettings
from support.otlp_receiver import OTLPReceiver
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(60)

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "trace me through prefill and decode " * 20}],
    "max_tokens": 4,
}
CHILDREN = {
    "smetric.parse",
    "smetric.queue_wait",
    "smetric.route",
    "smetric.prefill",
    "smetric.decode",
    "smetric.first_token",
    "smetric.stream",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_cluster(model_dir):
    made = []

    def make(tracing: dict | None = None, **kw) -> tuple[Cluster, InMemorySpanExporter]:
        router = dict(kw.pop("router", {}))
        if tracing is not None:
            router["tracing"] = tracing
        c = Cluster(model_dir, router=router, **kw)
        made.append(c)
        mem = InMemorySpanExporter()
        if c.state.tracing.enabled:
            c.state.tracing.add_span_processor(SimpleSpanProcessor(mem))
        return c, mem

    yield make
    for c in made:
        c.close()


def _parse_tp(value: str) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C traceparent."""
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16 and len(flags) == 2
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _by_name(spans) -> dict:
    return {s.name: s for s in spans}


def _stream(c: Cluster, headers: dict | None = None) -> list[bytes]:
    with c.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        return list(r.iter_bytes())


def _finished(mem: InMemorySpanExporter, n_roots: int = 1, timeout: float = 5.0):
    """The finished spans once ``n_roots`` root spans ended (a stream ends its root after the
    client read the last byte)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        spans = mem.get_finished_spans()
        if sum(1 for s in spans if s.kind == SpanKind.SERVER) >= n_roots:
            return spans
        assert time.monotonic() < deadline, [s.name for s in spans]
        time.sleep(0.02)


def test_streamed_request_spans_and_the_traceparent_each_worker_gets(make_cluster):
    c, mem = make_cluster({"enabled": True})
    chunks = _stream(c)
    assert b"[DONE]" in b"".join(chunks)
    spans = _finished(mem)
    by = _by_name(spans)
    root = by["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER and root.parent is None
    assert root.attributes["http.response.status_code"] == 200
    assert CHILDREN <= set(by)
    tid = root.context.trace_id
    for name in CHILDREN:
        s = by[name]
        assert s.context.trace_id == tid, name
        assert s.parent.span_id == root.context.span_id, name
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time, name
    route = by["smetric.route"].attributes
    assert route["smetric.policy"] == "smetric"
    assert route["smetric.decision"] == "first_turn"  # a one-turn chat
    p_url, d_url = route["smetric.prefill_worker"], route["smetric.decode_worker"]
    assert p_url in {s.url for s in c.servers[:2]} and d_url == c.servers[2].url
    assert by["smetric.stream"].attributes["smetric.stream.chunks"] >= 1
    assert [e.name for e in by["smetric.decode"].events] == ["first_token"]
    # each PD worker was handed its own span of the router's trace
    pw = c.worker_by_url(p_url)
    p_tid, p_sid, p_sampled = _parse_tp(pw.headers[-1]["traceparent"])
    d_tid, d_sid, d_sampled = _parse_tp(c.decode[0].headers[-1]["traceparent"])
    assert p_tid == d_tid == f"{tid:032x}" and p_sampled and d_sampled
    assert p_sid == f"{by['smetric.prefill'].context.span_id:016x}"
    assert d_sid == f"{by['smetric.decode'].context.span_id:016x}"
    assert by["smetric.prefill"].kind == by["smetric.decode"].kind == SpanKind.CLIENT
    # the spans follow the request's order
    assert by["smetric.parse"].end_time <= by["smetric.route"].start_time
    assert by["smetric.queue_wait"].end_time <= by["smetric.route"].end_time
    assert by["smetric.first_token"].end_time <= by["smetric.stream"].end_time


def test_a_colocated_pool_gets_one_client_span_until_the_answer_ends(make_cluster):
    c, mem = make_cluster({"enabled": True}, n_prefill=1, n_decode=0)
    _stream(c)
    by = _by_name(_finished(mem))
    assert "smetric.decode" not in by
    p, stream = by["smetric.prefill"], by["smetric.stream"]
    assert p.kind == SpanKind.CLIENT and p.end_time >= stream.end_time
    _tid, sid, _ = _parse_tp(c.prefill[0].headers[-1]["traceparent"])
    assert sid == f"{p.context.span_id:016x}"


def test_a_clients_traceparent_is_continued(make_cluster):
    c, mem = make_cluster({"enabled": True})
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = c.client.post(
        "/v1/chat/completions", json=CHAT, headers={"traceparent": f"00-{client_trace}-{client_span}-01"}
    )
    assert r.status_code == 200
    root = _by_name(_finished(mem))["POST /v1/chat/completions"]
    assert f"{root.context.trace_id:032x}" == client_trace
    assert f"{root.parent.span_id:016x}" == client_span
    assert _parse_tp(c.decode[0].headers[-1]["traceparent"])[0] == client_trace


def test_unsampled_requests_make_no_spans_but_pass_the_flag_on(make_cluster):
    c, mem = make_cluster({"enabled": True, "sampling_ratio": 0.0})
    assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert mem.get_finished_spans() == ()
    _tid, _sid, sampled = _parse_tp(c.decode[0].headers[-1]["traceparent"])
    assert not sampled  # the workers do not sample it either


def test_tracing_off_by_default_sends_no_traceparent(make_cluster):
    c, _ = make_cluster()
    assert not c.state.tracing.enabled
    _stream(c)
    assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    got = [h for w in c.prefill + c.decode for h in w.headers]
    assert len(got) == 4 and all("traceparent" not in h for h in got)  # 2 requests, 2 workers each


def test_errors_end_the_trace_with_their_status(make_cluster):
    c, mem = make_cluster({"enabled": True})
    r = c.client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    root = _by_name(_finished(mem))["POST /v1/chat/completions"]
    assert root.attributes["http.response.status_code"] == 400
    assert {s.name for s in mem.get_finished_spans()} == {"POST /v1/chat/completions"}


def test_no_worker_marks_the_route_span_failed(make_cluster):
    c, mem = make_cluster({"enabled": True}, n_prefill=0, dead_prefill=1)
    r = c.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    by = _by_name(_finished(mem))
    assert by["smetric.route"].status.is_ok is False
    assert by["smetric.route"].attributes["smetric.route.outcome"] == "no prefill worker"
    assert by["POST /v1/chat/completions"].attributes["http.response.status_code"] == 503


def test_a_retry_gets_a_route_span_per_attempt(make_cluster):
    c, mem = make_cluster({"enabled": True}, router={"policy": "round-robin"})
    c.prefill[0].fail = "500"
    for _ in range(2):  # one of the two lands on the failing worker first
        assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    spans = _finished(mem, 2)
    attempts = sorted(s.attributes["smetric.attempt"] for s in spans if s.name == "smetric.route")
    failed = [s for s in spans if s.name == "smetric.prefill" and not s.status.is_ok]
    # one failed call does not eject p0 (router.health_failures in a row do): each request that
    # met it first has a second route span
    assert attempts.count(0) == 2 and attempts.count(1) == len(failed) >= 1


def test_router_spans_are_exported_over_otlp_http(model_dir):
    with OTLPReceiver() as rx:
        c = Cluster(
            model_dir, router={"tracing": {"enabled": True, "endpoint": f"http://127.0.0.1:{rx.port}"}}
        )
        try:
            assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
        finally:
            c.close()  # the router's shutdown flushes its batch processor
        spans = rx.wait_for(lambda s: any(x.name == "POST /v1/chat/completions" for x in s))
    assert {s.service for s in spans} == {"smetric-router"}
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert {s.parent_span_id for s in spans if s is not root} == {root.span_id}


def test_tracing_config_is_checked():
    with pytest.raises(ValueError, match="tracing.sampling_ratio"):
        parse_config({"router": {"tracing": {"enabled": True, "sampling_ratio": 2}}})
    with pytest.raises(ValueError, match="must start with http"):
        parse_config({"router": {"tracing": {"endpoint": "collector:4317"}}})
    with pytest.raises(ValueError, match="tracing.protocol"):
        parse_config({"router": {"tracing": {"protocol": "thrift"}}})


# -- the emulated worker ------------------------------------------------------------------------
@pytest.fixture
def traced_worker():
    """An emulated decode worker with --enable-trace whose spans go to an in-memory exporter."""
    s = WorkerSettings(mode="colocated", name="emu-0", enable_trace=True, otlp_traces_endpoint="")
    app, _w = build_app(s)
    mem = InMemorySpanExporter()
    app.state.tracing.provider.add_span_processor(SimpleSpanProcessor(mem))
    srv = ServerThread(app).start()
    yield srv, mem
    srv.stop()


def test_emulated_worker_continues_the_trace_it_gets(traced_worker):
    srv, mem = traced_worker
    tid, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"model": "emulated-model", "prompt": "hello " * 40, "max_tokens": 3, "stream": True, "rid": "r-1"}
    with httpx.Client(base_url=srv.url, timeout=30) as cl:
        with cl.stream(
            "POST", "/v1/completions", json=body, headers={"traceparent": f"00-{tid}-{parent}-01"}
        ) as r:
            assert r.status_code == 200
            assert b"[DONE]" in b"".join(r.iter_bytes())
        assert cl.get("/health").status_code == 200  # not an inference path: no span
        r = cl.post("/v1/completions", json={"model": "x"})  # no prompt: SGLang's 400
        assert r.status_code == 400
    spans = mem.get_finished_spans()
    assert len(spans) == 2
    s = next(x for x in spans if x.attributes.get("smetric.rid") == "r-1")
    assert s.name == "colocated /v1/completions" and s.kind == SpanKind.SERVER
    assert f"{s.context.trace_id:032x}" == tid and f"{s.parent.span_id:016x}" == parent
    assert s.attributes["http.response.status_code"] == 200
    assert s.attributes["smetric.prompt_tokens"] > 0
    assert s.resource.attributes["smetric.worker"] == "emu-0"
    bad = next(x for x in spans if x is not s)
    assert bad.attributes["http.response.status_code"] == 400 and bad.parent is None


def test_emulated_workers_join_the_routers_trace(model_dir, tmp_path):
    """Router (tracing on) -> emulated prefill + decode workers (--enable-trace): each worker's
    span is a child of the router span that sent it, in the router's trace."""
    mems = []
    servers = []
    for mode in ("prefill", "decode"):
        s = WorkerSettings(
            mode=mode,
            name=f"emu-{mode}",
            tokenizer=str(model_dir),
            page_size=16,
            enable_trace=True,
            otlp_traces_endpoint="",
            kv_transport="http",
        )
        app, _w = build_app(s)
        mem = InMemorySpanExporter()
        app.state.tracing.provider.add_span_processor(SimpleSpanProcessor(mem))
        mems.append(mem)
        servers.append(ServerThread(app).start())
    p_srv, d_srv = servers
    from stack.prefill_router.service import create_app

    cfg = parse_config(
        {
            "model": {"name": "tiny", "path": str(model_dir), "page_size": 16, "context_length": 8192},
            "router": {"tracing": {"enabled": True}, "health_interval_s": 0.2},
            "prefill": [{"url": p_srv.url, "bootstrap_port": p_srv.port}],
            "decode": [{"url": d_srv.url}],
        }
    )
    app = create_app(cfg)
    rmem = InMemorySpanExporter()
    app.state.router.tracing.add_span_processor(SimpleSpanProcessor(rmem))
    router = ServerThread(app).start()
    try:
        with httpx.Client(base_url=router.url, timeout=30) as cl:
            with cl.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                assert r.status_code == 200, r.read()
                data = b"".join(r.iter_bytes())
        assert b"[DONE]" in data and orjson.loads(data.split(b"\n\n")[0][6:])["choices"]
        rspans = _by_name(_finished(rmem))
    finally:
        router.stop()
        for s in servers:
            s.stop()
    tid = rspans["POST /v1/chat/completions"].context.trace_id
    (pspan,) = mems[0].get_finished_spans()
    (dspan,) = mems[1].get_finished_spans()
    assert pspan.context.trace_id == dspan.context.trace_id == tid
    assert pspan.parent.span_id == rspans["smetric.prefill"].context.span_id
    assert dspan.parent.span_id == rspans["smetric.decode"].context.span_id
    assert pspan.attributes["smetric.bootstrap_room"] == dspan.attributes["smetric.bootstrap_room"]
