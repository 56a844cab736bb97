"""OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/models``."""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.worker.http.encoding import error_response, json_response
from stack.worker.http.parse import (
    BodyParser,
    admit,
    parse_chat,
    parse_completion,
    parse_embedding_input,
    read_body,
)
from stack.worker.http.relay import answer
from stack.worker.http.shapes import embeddings as embedding_shape
from stack.worker.http.shapes import openai
from stack.worker.request_path import Worker
from stack.worker.tool_calls import forced_call


async def _complete(request: Request, w: Worker, kind: openai.CompletionKind, parse: BodyParser) -> Response:
    """One completion endpoint: parse, run, answer in ``kind``'s shape (streamed on request)."""
    try:
        body, req = await admit(request, w, parse)
    except (ValueError, TypeError) as ex:
        return error_response(str(ex))
    try:
        asked = openai.extras(kind, body, _storage_backend(w))
    except ValueError as e:
        return error_response(str(e))
    call = None
    if kind is openai.CHAT:
        call = forced_call(body.get("tools"), body.get("tool_choice"), w.s.tool_call_parser, req.rid, req.L)
        req.params.tool_call = call
    h = openai.head(kind, req.rid, body.get("model") or w.s.model, call)
    stream = None
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = openai.CompletionStream(kind, h, include_usage, asked)
    return await answer(
        w.execute(req), stream, partial(openai.completion_object, kind, h, ex=asked), w.s.stream_interval
    )


def _storage_backend(w: Worker) -> str | None:
    """The global tier, as SGLang names its storage backend in ``cached_tokens_details``."""
    if w.s.lmcache_url:
        return "lmcache"
    return "mooncake" if w.s.mooncake_master else None


async def chat_completions(request: Request, w: Worker) -> Response:
    return await _complete(request, w, openai.CHAT, parse_chat)


async def completions(request: Request, w: Worker) -> Response:
    return await _complete(request, w, openai.TEXT, parse_completion)


async def embeddings(request: Request, w: Worker) -> Response:
    """``/v1/embeddings``: each prompt's deterministic vector (:mod:`.shapes.embeddings`); no
    model and no engine time (the emulator emulates generation, not an embedding model)."""
    try:
        body = await read_body(request)
        prompts = parse_embedding_input(body, w.engine.tokenizer)
    except (ValueError, TypeError) as ex:
        return error_response(str(ex))
    return json_response(embedding_shape.embedding_list(prompts, body.get("model") or w.s.model))


def add_openai_routes(app: FastAPI, w: Worker) -> None:
    """The OpenAI GETs (``/v1/models``); the POSTs are in :mod:`.endpoints`' table."""
    e = w.engine

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(
            openai.model_list(w.s.model, int(e.started), e.cache.capacity_pages * w.s.page_size)
        )
