"""FastAPI app speaking SGLang 0.5.23's worker API on top of the emulated ``Engine``.

Endpoints: ``/generate``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/health_generate``, ``/server_info`` (and ``/get_server_info``),
``/get_model_info``, ``/v1/loads``, ``/flush_cache``, ``/abort_request``, ``/metrics``; on a
prefill worker also the bootstrap endpoint ``/kv/register`` (on its bootstrap port).

PD: a request carrying ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` is one half of
a PD pair. The prefill half prefills, writes the KV to the decode half through the
TransferEngine and answers with its first token; the decode half registers a receive region
with the prefill's bootstrap server, waits for the bytes, verifies them and generates.
Without bootstrap fields a prefill (or colocated) worker serves the request alone, and a decode
worker generates without KV (like SGLang's ``fake`` transfer backend).

Hit accounting: ``meta_info.cached_tokens`` (SGLang's field, local + global) plus
``cached_tokens_local``, ``cached_tokens_global`` and an ``emulator`` block with timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from stack.worker.engine import Aborted, Engine, GenParams, Req
from stack.worker.settings import WorkerSettings

log = logging.getLogger("stack.worker")
VERSION = "0.5.23-emulated"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _err(msg: str, status: int = 400) -> Response:
    return _json({"object": "error", "message": msg, "type": "BadRequestError", "code": status}, status)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _stop_list(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [x for x in v if isinstance(x, str)]


def _bootstrap(body: dict) -> dict:
    room = body.get("bootstrap_room")
    if isinstance(room, list):
        raise ValueError("batched bodies (lists of bootstrap_room) are not supported by the emulator")
    port = body.get("bootstrap_port")
    return {
        "bootstrap_host": body.get("bootstrap_host"),
        "bootstrap_port": int(port) if port is not None else None,
        "bootstrap_room": int(room) if room is not None else None,
    }


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.engine = Engine(settings)

    # -- the request path, shared by every endpoint --------------------------------------------
    async def execute(self, req: Req) -> AsyncIterator[dict]:
        """Yields ``{"token": id, "text": piece}`` items and finally ``{"done": meta}``."""
        e = self.engine
        s = self.s
        info: dict[str, Any] = {}
        task = asyncio.current_task()
        if task is not None:
            e.tasks[req.rid] = task
        try:
            if s.mode == "decode":
                e.decoding[req.rid] = req
                e.c.requests += 1
                e.c.prompt_tokens += req.L
                if req.pd:
                    info = await e.receive_kv(req)
                    info.pop("ok", None)
                else:
                    info = {"cached_tokens": 0, "cached_tokens_local": 0, "cached_tokens_global": 0}
            else:
                await e.prefill(req)
                e.account_hits(req)
                e.decoding[req.rid] = req  # abortable while it hands off / decodes
                if s.mode == "prefill" and req.pd:
                    _, sent = await asyncio.gather(e.store_write(req), e.send_kv(req))
                    info = dict(sent)
                    if not sent.get("ok"):
                        raise RuntimeError(f"KV transfer failed: {sent.get('error')}")
                    info.pop("ok", None)
                else:
                    await e.store_write(req)
                    info = e.prefill_meta(req)
            ttft = time.monotonic() - req.t_arrive
            e.c.ttft_sum += ttft
            plan, finish = e.plan_output(req)
            if s.mode == "prefill" and req.pd:
                plan, finish = plan[:1], {"type": "length", "length": 1}
            n = 0
            if plan:
                async for i in e.pace_tokens(len(plan)):
                    tid, piece = plan[i]
                    n += 1
                    yield {"token": tid, "text": piece}
            e.c.generation_tokens += n
            e.c.finished += 1
            meta = {
                "id": req.rid,
                "finish_reason": finish,
                "prompt_tokens": req.L,
                "completion_tokens": n,
                "cached_tokens": int(info.get("cached_tokens", 0)),
                "cached_tokens_local": int(info.get("cached_tokens_local", 0)),
                "cached_tokens_global": int(info.get("cached_tokens_global", 0)),
                "e2e_latency": time.monotonic() - req.t_arrive,
                "ttft": ttft,
                "emulator": {"worker": s.name, "mode": s.mode, **info},
            }
            yield {"done": meta}
        except (asyncio.CancelledError, Aborted):  # counted in Engine.abort
            if s.mode == "prefill" and req.pd:
                e.fail_room(req.bootstrap_room, "prefill request aborted")
            yield {
                "done": {
                    "id": req.rid,
                    "finish_reason": {"type": "abort", "message": "aborted"},
                    "prompt_tokens": req.L,
                    "completion_tokens": 0,
                    "cached_tokens": 0,
                }
            }
        except Exception as ex:  # a failed hand-off or twin timeout: SGLang answers an abort too
            log.warning("request %s failed: %s", req.rid, ex)
            if s.mode == "prefill" and req.pd:
                e.fail_room(req.bootstrap_room, f"prefill failed: {ex}")
            yield {
                "done": {
                    "id": req.rid,
                    "finish_reason": {"type": "abort", "message": str(ex)},
                    "prompt_tokens": req.L,
                    "completion_tokens": 0,
                    "cached_tokens": 0,
                }
            }
        finally:
            e.tasks.pop(req.rid, None)
            e.decoding.pop(req.rid, None)

    def make_req(
        self, body: dict, tokens: list[int], params: GenParams, t_arrive: float | None = None
    ) -> Req:
        """``t_arrive``: when the HTTP request was received (TTFT counts parsing and tokenizing)."""
        req = self.engine.new_req(tokens, params, rid=body.get("rid"), **_bootstrap(body))
        if t_arrive is not None:
            req.t_arrive = t_arrive
        return req

    def tokenize_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode_prompt(prompt)
        raise ValueError("prompt must be a string or a list of token ids")


def build_app(settings: WorkerSettings) -> tuple[FastAPI, Worker]:
    w = Worker(settings)
    e = w.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await e.start()
        try:
            yield
        finally:
            await e.stop()

    app = FastAPI(title=f"smetric emulated SGLang worker ({settings.mode})", lifespan=lifespan)

    # -- native API ------------------------------------------------------------------------------
    async def _body(request: Request) -> dict:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as ex:
            raise ValueError(f"invalid JSON body: {ex}") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    @app.post("/generate")
    async def generate(request: Request):
        t0 = time.monotonic()
        try:
            body = await _body(request)
        except ValueError as ex:
            return _err(str(ex))
        sp = body.get("sampling_params") or {}
        try:
            if body.get("input_ids") is not None:
                ids = body["input_ids"]
                if ids and isinstance(ids[0], list):
                    return _err("batched input_ids are not supported by the emulator")
                tokens = list(ids)
            elif isinstance(body.get("text"), str):
                tokens = e.tokenizer.encode_prompt(body["text"])
            else:
                return _err("`text` (a string) or `input_ids` is required (batches are not supported)")
            params = GenParams(
                max_new_tokens=int(sp.get("max_new_tokens", 128))
                if sp.get("max_new_tokens", 128) is not None
                else None,
                stop=_stop_list(sp.get("stop")),
                ignore_eos=bool(sp.get("ignore_eos", False)),
            )
            req = w.make_req(body, tokens, params, t0)
        except (ValueError, TypeError) as ex:
            return _err(str(ex))
        if body.get("stream"):

            async def gen():
                text, ids = "", []
                async for item in w.execute(req):
                    if "token" in item:
                        text += item["text"]
                        ids.append(item["token"])
                        yield _sse(
                            {
                                "text": text,
                                "output_ids": list(ids),
                                "meta_info": {
                                    "id": req.rid,
                                    "finish_reason": None,
                                    "prompt_tokens": req.L,
                                    "completion_tokens": len(ids),
                                },
                            }
                        )
                    else:
                        yield _sse({"text": text, "output_ids": ids, "meta_info": item["done"]})
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        text, ids, meta = "", [], {}
        async for item in w.execute(req):
            if "token" in item:
                text += item["text"]
                ids.append(item["token"])
            else:
                meta = item["done"]
        return _json({"text": text, "output_ids": ids, "meta_info": meta})

    # -- OpenAI-compatible API ----------------------------------------------------------------------
    def _usage(meta: dict) -> dict:
        return {
            "prompt_tokens": meta.get("prompt_tokens", 0),
            "completion_tokens": meta.get("completion_tokens", 0),
            "total_tokens": meta.get("prompt_tokens", 0) + meta.get("completion_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
        }

    def _finish(meta: dict) -> str:
        fr = (meta.get("finish_reason") or {}).get("type")
        return {"length": "length", "abort": "abort"}.get(fr, "stop")

    async def _openai(request: Request, chat: bool):
        t0 = time.monotonic()
        try:
            body = await _body(request)
        except ValueError as ex:
            return _err(str(ex))
        try:
            if chat:
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    return _err("`messages` must be a non-empty list")
                tokens = e.tokenizer.encode_chat(body)
            else:
                if "prompt" not in body:
                    return _err("`prompt` is required")
                tokens = w.tokenize_prompt(body["prompt"])
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
            if mt is None and not chat:
                mt = 16
            params = GenParams(
                max_new_tokens=int(mt) if mt is not None else None,
                stop=_stop_list(body.get("stop")),
                ignore_eos=bool(body.get("ignore_eos", False)),
            )
            req = w.make_req(body, tokens, params, t0)
        except (ValueError, TypeError) as ex:
            return _err(str(ex))
        model = body.get("model") or settings.model
        created = int(time.time())
        cid = ("chatcmpl-" if chat else "cmpl-") + req.rid
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def gen():
                first = True
                async for item in w.execute(req):
                    if "token" in item:
                        if chat:
                            delta = {"content": item["text"]}
                            if first:
                                delta = {"role": "assistant", "content": item["text"]}
                            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                        else:
                            choice = {
                                "index": 0,
                                "text": item["text"],
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        first = False
                        yield _sse(
                            {
                                "id": cid,
                                "object": obj + (".chunk" if chat else ""),
                                "created": created,
                                "model": model,
                                "choices": [choice],
                            }
                        )
                    else:
                        meta = item["done"]
                        if chat:
                            choice = {
                                "index": 0,
                                "delta": {} if not first else {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": _finish(meta),
                            }
                        else:
                            choice = {
                                "index": 0,
                                "text": "",
                                "logprobs": None,
                                "finish_reason": _finish(meta),
                            }
                        yield _sse(
                            {
                                "id": cid,
                                "object": obj + (".chunk" if chat else ""),
                                "created": created,
                                "model": model,
                                "choices": [choice],
                                "meta_info": meta,
                            }
                        )
                        if include_usage:
                            yield _sse(
                                {
                                    "id": cid,
                                    "object": obj + (".chunk" if chat else ""),
                                    "created": created,
                                    "model": model,
                                    "choices": [],
                                    "usage": _usage(meta),
                                }
                            )
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        text, meta = "", {}
        async for item in w.execute(req):
            if "token" in item:
                text += item["text"]
            else:
                meta = item["done"]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": _finish(meta),
                "matched_stop": (meta.get("finish_reason") or {}).get("matched"),
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": _finish(meta),
                "matched_stop": (meta.get("finish_reason") or {}).get("matched"),
            }
        return _json(
            {
                "id": cid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": _usage(meta),
                "meta_info": meta,
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _openai(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _openai(request, chat=False)

    @app.get("/v1/models")
    async def models():
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.model,
                        "object": "model",
                        "created": int(e.started),
                        "owned_by": "sglang",
                        "root": settings.model,
                        "max_model_len": e.cache.capacity_pages * settings.page_size,
                    }
                ],
            }
        )

    # -- health, info, load -----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200 if e.ready else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not e.ready:
            return Response(status_code=503)
        if settings.mode != "decode" and (e._loop_task is None or e._loop_task.done()):
            return Response(status_code=503)
        return Response(status_code=200)

    def server_info() -> dict:
        return {
            "model_path": settings.model,
            "served_model_name": settings.model,
            "tokenizer_path": settings.tokenizer or e.tokenizer.name,
            "page_size": settings.page_size,
            "disaggregation_mode": {"colocated": "null"}.get(settings.mode, settings.mode),
            "disaggregation_bootstrap_port": settings.bootstrap_port or settings.port,
            "disaggregation_transfer_backend": "mooncake_tcp",
            "kv_events_config": orjson.dumps(
                {
                    "publisher": "zmq",
                    "endpoint": settings.kv_events_endpoint,
                    "topic": settings.kv_events_topic,
                }
            ).decode()
            if settings.kv_events_endpoint
            else None,
            "max_total_num_tokens": e.cache.capacity_pages * settings.page_size,
            "chunked_prefill_size": e.chunk_tokens,
            "host": settings.host,
            "port": settings.port,
            "version": VERSION,
            "emulator": {
                **settings.to_dict(),
                "hardware_name": e.hw.name,
                "transfer_peer": e.transfer.peer if e.transfer is not None else None,
                "store_client": e.store.name if e.store is not None else None,
            },
            "internal_states": [
                {
                    "kv_events_seq": e.publisher.seq,
                    "cached_pages": len(e.cache),
                    "cache_stats": vars(e.cache.stats),
                    **{k: v for k, v in vars(e.c).items()},
                }
            ],
        }

    @app.get("/server_info")
    async def get_server_info():
        return _json(server_info())

    @app.get("/get_server_info")
    async def get_server_info_old():
        return _json(server_info())

    @app.get("/get_model_info")
    async def get_model_info():
        return _json(
            {"model_path": settings.model, "tokenizer_path": settings.tokenizer, "is_generation": True}
        )

    @app.get("/v1/loads")
    async def loads():
        ld = e.loads()
        return _json(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": VERSION,
                "dp_rank_count": 1,
                "loads": [ld],
                "aggregate": {
                    "total_running_reqs": ld["num_running_reqs"],
                    "total_waiting_reqs": ld["num_waiting_reqs"],
                    "total_reqs": ld["num_total_reqs"],
                    "avg_token_usage": ld["token_usage"],
                    "avg_throughput": 0.0,
                    "avg_utilization": ld["utilization"],
                },
            }
        )

    @app.get("/get_load")
    async def get_load():
        # SGLang's older load endpoint, one entry per DP rank; sglang-router 0.3.x polls it for
        # power_of_two and sums num_tokens (without it every load reads -1 and the policy picks
        # at random). num_tokens: prompt tokens of the requests in prefill plus the queued
        # uncached ones (SGLang: KV held by running requests plus the waiting queue's tokens).
        ld = e.loads()
        busy = sum(r.L for r in list(e.running))
        return _json(
            [
                {
                    "dp_rank": ld["dp_rank"],
                    "num_reqs": ld["num_total_reqs"],
                    "num_waiting_reqs": ld["num_waiting_reqs"],
                    "num_tokens": busy + ld["num_waiting_uncached_tokens"],
                }
            ]
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if e.cache.clear():
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Cache not flushed: requests hold pages.\n", status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = await request.json()
        except Exception:
            body = {}
        n = e.abort(body.get("rid"), bool(body.get("abort_all", False)))
        return _json({"aborted": n})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(w), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- PD bootstrap (also served on the bootstrap port) -----------------------------------------
    add_bootstrap_routes(app, w)
    return app, w


def add_bootstrap_routes(app: FastAPI, w: Worker) -> None:
    @app.post("/kv/register")
    async def kv_register(request: Request):
        if w.s.mode != "prefill":
            return _err("not a prefill worker", 404)
        b = await request.json()
        info = await w.engine.register_decode(
            int(b["room"]), str(b["peer"]), int(b["addr"]), int(b["nbytes"])
        )
        return _json(info)

    @app.get("/route")
    async def route():
        return _json({"prefill": w.s.name, "host": w.s.host, "port": w.s.port, "mode": w.s.mode})


def build_bootstrap_app(w: Worker) -> FastAPI:
    app = FastAPI(title="smetric emulated PD bootstrap server")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if w.engine.ready else 503)

    add_bootstrap_routes(app, w)
    return app


def render_metrics(w: Worker) -> str:
    e = w.engine
    c = e.c
    lab = f'{{model_name="{w.s.model}",worker="{w.s.name}",mode="{w.s.mode}"}}'
    ld = e.loads()
    rows: list[tuple[str, str, str, float]] = [
        ("sglang:num_running_reqs", "gauge", "running requests", ld["num_running_reqs"]),
        ("sglang:num_queue_reqs", "gauge", "waiting requests", ld["num_waiting_reqs"]),
        ("sglang:num_used_tokens", "gauge", "tokens held by the prefix cache", ld["num_used_tokens"]),
        ("sglang:token_usage", "gauge", "cache usage ratio", ld["token_usage"]),
        ("sglang:cache_hit_rate", "gauge", "cached / prompt tokens", ld["cache_hit_rate"]),
        ("sglang:prompt_tokens_total", "counter", "prompt tokens", c.prompt_tokens),
        ("sglang:generation_tokens_total", "counter", "output tokens", c.generation_tokens),
        (
            "sglang:cached_tokens_total",
            "counter",
            "prompt tokens served from a cache (local+global)",
            c.cached_tokens,
        ),
        ("sglang:num_requests_total", "counter", "requests received", c.requests),
        (
            "smetric_worker_cached_tokens_local_total",
            "counter",
            "prompt tokens hit in the local prefix cache",
            c.cached_tokens_local,
        ),
        (
            "smetric_worker_cached_tokens_global_total",
            "counter",
            "prompt tokens read back from the Mooncake global tier",
            c.cached_tokens_global,
        ),
        ("smetric_worker_computed_tokens_total", "counter", "prompt tokens computed", c.computed_tokens),
        (
            "smetric_worker_queued_prefill_seconds",
            "gauge",
            "modelled prefill seconds queued or running",
            ld["queued_prefill_s"],
        ),
        (
            "smetric_worker_store_fetch_pages_total",
            "counter",
            "pages read from the global tier",
            c.store_fetch_pages,
        ),
        (
            "smetric_worker_store_fetch_seconds_total",
            "counter",
            "seconds spent reading the global tier",
            c.store_fetch_seconds,
        ),
        (
            "smetric_worker_store_write_pages_total",
            "counter",
            "pages written to the global tier",
            c.store_write_pages,
        ),
        ("smetric_worker_store_errors_total", "counter", "global-tier errors", c.store_errors),
        (
            "smetric_worker_kv_transfer_bytes_sent_total",
            "counter",
            "KV bytes sent to decode workers",
            c.kv_transfer_bytes_sent,
        ),
        (
            "smetric_worker_kv_transfer_bytes_received_total",
            "counter",
            "KV bytes received from prefill workers",
            c.kv_transfer_bytes_received,
        ),
        (
            "smetric_worker_kv_transfer_verified_total",
            "counter",
            "hand-offs whose bytes matched",
            c.kv_transfer_verified,
        ),
        (
            "smetric_worker_kv_transfer_mismatch_total",
            "counter",
            "hand-offs whose bytes did not match",
            c.kv_transfer_mismatch,
        ),
        (
            "smetric_worker_bootstrap_timeouts_total",
            "counter",
            "PD twins that never arrived",
            c.bootstrap_timeouts,
        ),
        ("smetric_worker_aborted_total", "counter", "aborted requests", c.aborted),
        ("smetric_worker_kv_events_seq", "gauge", "last published KV-event sequence number", e.publisher.seq),
        ("smetric_worker_cache_pages", "gauge", "pages in the prefix cache", len(e.cache)),
        ("smetric_worker_cache_evicted_pages_total", "counter", "pages evicted", e.cache.stats.removed_pages),
    ]
    out = []
    for name, kind, help_, val in rows:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{lab} {float(val)}")
    return "\n".join(out) + "\n"


def make_req_id() -> str:
    return uuid.uuid4().hex


# -- fault injection (tests) -----------------------------------------------------------------------
def with_faults(app, settings: WorkerSettings):
    """The app, wrapped in :class:`FaultInjector` only when a fault is set or ``fault_control`` is
    on: a worker started normally exposes no ``/debug/fault``."""
    return FaultInjector(app, settings) if settings.fault or settings.fault_control else app


_GEN_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


class FaultInjector:
    """ASGI wrapper: the faults of ``WorkerSettings.fault``, and ``POST /debug/fault`` to change
    them at run time (``{"fault": "slow" | "malformed" | null, "delay_s": 30}``). Installed only
    when a fault is set or ``fault_control`` is on."""

    def __init__(self, app, settings: WorkerSettings) -> None:
        self.app = app
        self.s = settings

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path == "/debug/fault" and method == "POST":
            return await self._set(receive, send)
        fault = self.s.fault
        if fault == "slow":
            await asyncio.sleep(self.s.fault_delay_s)
        elif fault == "malformed" and method == "POST" and path in _GEN_PATHS:
            return await self._malformed(receive, send)
        elif fault == "malformed" and path == "/v1/loads":
            return await _raw(send, 200, b"application/json", b'{"loads": [{"num_running_reqs": "lots"}]}')
        return await self.app(scope, receive, send)

    async def _body(self, receive) -> bytes:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                return body

    async def _set(self, receive, send) -> None:
        try:
            b = orjson.loads(await self._body(receive))
            fault = b.get("fault")
            WorkerSettings(fault=fault)  # validates
            delay = None if b.get("delay_s") is None else float(b["delay_s"])
        except (ValueError, TypeError, AttributeError) as ex:
            return await _raw(send, 400, b"application/json", orjson.dumps({"error": str(ex)}))
        self.s.fault = fault
        if delay is not None:
            self.s.fault_delay_s = delay
        log.warning("fault injection: %s", fault)
        await _raw(send, 200, b"application/json", orjson.dumps({"fault": fault}))

    async def _malformed(self, receive, send) -> None:
        try:
            stream = bool(orjson.loads(await self._body(receive)).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            return await _raw(send, 200, b"application/json", b'{"id": "x", "choices": [{"message": {"con')
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        ok = b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
        await send({"type": "http.response.body", "body": ok, "more_body": True})
        await asyncio.sleep(0.01)
        bad = b'data: {"choices": [{"index": 0, "delta": \xff\xfe not json\n\n'
        await send({"type": "http.response.body", "body": bad, "more_body": False})


async def _raw(send, status: int, ctype: bytes, data: bytes) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# -- serving ---------------------------------------------------------------------------------------
def serve(settings: WorkerSettings, log_level: str = "warning") -> None:
    """Run the worker (and its bootstrap server) until SIGINT/SIGTERM."""
    import signal

    import uvicorn

    app, w = build_app(settings)

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # we install our own handlers for both servers
            yield

    servers = [
        _Server(
            uvicorn.Config(
                with_faults(app, settings),
                host=settings.host,
                port=settings.port,
                log_level=log_level,
                access_log=False,
                lifespan="on",
            )
        )
    ]
    if settings.mode == "prefill" and settings.bootstrap_port and settings.bootstrap_port != settings.port:
        servers.append(
            _Server(
                uvicorn.Config(
                    build_bootstrap_app(w),
                    host=settings.host,
                    port=settings.bootstrap_port,
                    log_level=log_level,
                    access_log=False,
                    lifespan="off",
                )
            )
        )

    async def main():
        loop = asyncio.get_running_loop()

        def stop(*_):
            for s in servers:
                s.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        await asyncio.gather(*(s.serve() for s in servers))

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(main())


__all__ = ["build_app", "build_bootstrap_app", "serve", "Worker", "JSONResponse"]
