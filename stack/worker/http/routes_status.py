"""Health, identity and load: what routers and launchers poll.

``/health`` and ``/health_generate`` (readiness), ``/server_info`` (and the older
``/get_server_info``), ``/model_info`` (and the older ``/get_model_info``), ``/v1/tokenize``
(and ``/tokenize``: the worker's own token counts, so a client can size its prompts),
``/v1/loads`` and the older ``/get_load``.
The bodies are built by the named functions below so a reader sees each one whole.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.models.info import sglang_model_info
from stack.worker.http.encoding import error_response, json_response
from stack.worker.load import rank_load
from stack.worker.request_path import Worker
from stack.worker.settings import disaggregation_mode

VERSION = "0.5.23-emulated"


def server_info(w: Worker) -> dict[str, Any]:
    """SGLang's ``/server_info`` fields that routers and launchers read, plus the emulator's
    settings and counters (``emulator``, ``internal_states``)."""
    s, e = w.s, w.engine
    return {
        "model_path": s.model,
        "served_model_name": s.model,
        "tokenizer_path": s.tokenizer or e.tokenizer.name,
        "page_size": s.page_size,
        "disaggregation_mode": disaggregation_mode(s.mode),
        "disaggregation_bootstrap_port": s.bootstrap_port or s.port,
        "disaggregation_transfer_backend": "mooncake_tcp",
        "kv_events_config": orjson.dumps(
            {"publisher": "zmq", "endpoint": s.kv_events_endpoint, "topic": s.kv_events_topic}
        ).decode()
        if s.kv_events_endpoint
        else None,
        "max_total_num_tokens": e.cache.capacity_pages * s.page_size,
        "chunked_prefill_size": e.chunk_tokens,
        "enable_metrics": s.enable_metrics,
        # SGLang's priority-scheduling server args, as its /server_info reports them
        "enable_priority_scheduling": s.enable_priority_scheduling,
        "disable_priority_preemption": s.disable_priority_preemption,
        "schedule_low_priority_values_first": s.schedule_low_priority_values_first,
        "host": s.host,
        "port": s.port,
        "version": VERSION,
        "emulator": {
            **s.to_dict(),
            "hardware_name": e.hw.name,
            "transfer_peer": e.handoff.transfer.peer if e.handoff.transfer is not None else None,
            "store_client": e.tier.store.name if e.tier.store is not None else None,
        },
        "internal_states": [
            {
                "kv_events_seq": e.publisher.seq,
                "cached_pages": len(e.cache),
                # pages held by requests (their KV in use); 0 once every request ended or was aborted
                "held_pages": sum(1 for b in list(e.cache.blocks.values()) if b.ref),
                "open_rooms": len(e.handoff.rooms),  # PD rendezvous of a prefill worker not yet settled
                "cache_stats": vars(e.cache.stats),
                "model_clock": e.clock.stats.as_dict(),
                **{k: v for k, v in vars(e.c).items()},
            }
        ],
    }


#: ``max_model_len`` the emulator reports (it enforces no context length itself)
CONTEXT_LENGTH = 131072


def model_info(w: Worker) -> dict[str, Any]:
    """SGLang's ``/model_info``: ``tokenizer_path`` is null with the built-in hash tokenizer."""
    s = w.s
    return sglang_model_info(s.model, s.model, s.tokenizer, {"colocated": "null"}.get(s.mode, s.mode))


def tokenize(w: Worker, body: Any) -> dict[str, Any] | str:
    """SGLang's ``/v1/tokenize`` answer to ``body`` ({prompt: str | [str]} or {messages}),
    or the message of a 400."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        return "Exactly one of 'prompt' or 'messages' must be provided."
    tok = w.engine.tokenizer
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "'messages' must be an array of objects"
        try:
            ids: Any = tok.encode_chat(body)
        except Exception as e:  # a template that rejects the messages
            return f"cannot apply the chat template: {e}"
        count: Any = len(ids)
    elif isinstance(prompt, str):
        ids = tok.encode_prompt(prompt)
        count = len(ids)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        ids = [tok.encode_prompt(p) for p in prompt]
        count = [len(i) for i in ids]
    else:
        return "'prompt' must be a string or a non-empty array of strings"
    return {"tokens": ids, "count": count, "max_model_len": CONTEXT_LENGTH}


def loads_report(w: Worker) -> dict[str, Any]:
    """``/v1/loads``: SGLang's per-DP-rank loads (one rank) and their aggregate."""
    ld = rank_load(w.engine)
    return {
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


def legacy_load(w: Worker) -> list[dict[str, Any]]:
    """SGLang's older ``/get_load``, one entry per DP rank; sglang-router 0.3.x polls it for
    power_of_two and sums ``num_tokens`` (without it every load reads -1 and the policy picks at
    random). ``num_tokens``: prompt tokens of the requests in prefill plus the queued uncached
    ones (SGLang: KV held by running requests plus the waiting queue's tokens)."""
    e = w.engine
    ld = rank_load(e)
    busy = sum(r.L for r in list(e.scheduler.running))
    return [
        {
            "dp_rank": ld["dp_rank"],
            "num_reqs": ld["num_total_reqs"],
            "num_waiting_reqs": ld["num_waiting_reqs"],
            "num_tokens": busy + ld["num_waiting_uncached_tokens"],
        }
    ]


def generation_ready(w: Worker) -> bool:
    """Ready, and (prefill / colocated) its scheduler still runs: a dead scheduler would accept
    requests and never answer them."""
    if not w.engine.ready:
        return False
    return w.s.mode == "decode" or w.engine.scheduler.alive


def add_status_routes(app: FastAPI, w: Worker) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if w.engine.ready else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if generation_ready(w) else 503)

    @app.get("/server_info")
    async def get_server_info() -> Response:
        return json_response(server_info(w))

    @app.get("/get_server_info")
    async def get_server_info_old() -> Response:
        return json_response(server_info(w))

    @app.get("/model_info")
    async def get_model_info_new() -> Response:
        return json_response(model_info(w))

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return json_response(model_info(w))

    async def tokenize_route(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = None
        out = await asyncio.to_thread(tokenize, w, body)
        if isinstance(out, str):
            return error_response(out, 400)
        return json_response(out)

    for path in ("/v1/tokenize", "/tokenize"):
        app.add_api_route(path, tokenize_route, methods=["POST"])

    @app.get("/v1/loads")
    async def loads() -> Response:
        return json_response(loads_report(w))

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response(legacy_load(w))
