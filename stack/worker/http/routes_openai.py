"""OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``."""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.worker.http.encoding import error_response, json_response
from stack.worker.http.parse import BodyParser, admit, parse_chat, parse_completion
from stack.worker.http.relay import answer
from stack.worker.http.shapes import openai
from stack.worker.request_path import Worker


async def _complete(request: Request, w: Worker, kind: openai.CompletionKind, parse: BodyParser) -> Response:
    """One completion endpoint: parse, run, answer in ``kind``'s shape (streamed on request)."""
    try:
        body, req = await admit(request, w, parse)
    except (ValueError, TypeError) as ex:
        return error_response(str(ex))
    h = openai.head(kind, req.rid, body.get("model") or w.s.model)
    stream = None
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = openai.CompletionStream(kind, h, include_usage)
    return await answer(
        w.execute(req), stream, partial(openai.completion_object, kind, h), w.s.stream_interval
    )


def add_openai_routes(app: FastAPI, w: Worker) -> None:
    e = w.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(request, w, openai.CHAT, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, w, openai.TEXT, parse_completion)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(
            openai.model_list(w.s.model, int(e.started), e.cache.capacity_pages * w.s.page_size)
        )
