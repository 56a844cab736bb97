"""The emulated worker's inference endpoints, one table: each POST path's handler (its body
parser and answer shape inside), the API whose error shape it answers in, and whether the
``malformed`` test fault (:mod:`.faults`) breaks its answers.

A new SGLang endpoint is one :class:`Endpoint` in :data:`ENDPOINTS` plus its handler (in a
``routes_*`` module); :func:`add_inference_routes` and the fault injector read the rest here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from stack.worker.http import routes_agents, routes_openai, routes_sglang
from stack.worker.request_path import Worker


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference endpoint of the emulated worker."""

    #: the handler: parse the body, run it, answer in the API's shape
    serve: Callable[[Request, Worker], Awaitable[Response]]
    #: whose error body it answers with: SGLang's OpenAI-shaped one, or Anthropic's
    errors: Literal["openai", "anthropic"] = "openai"
    #: the ``malformed`` fault answers it with a truncated body or a broken stream
    malformed_fault: bool = False


#: POST path -> endpoint
ENDPOINTS: dict[str, Endpoint] = {
    "/generate": Endpoint(routes_sglang.generate, malformed_fault=True),
    "/v1/chat/completions": Endpoint(routes_openai.chat_completions, malformed_fault=True),
    "/v1/completions": Endpoint(routes_openai.completions, malformed_fault=True),
    "/v1/embeddings": Endpoint(routes_openai.embeddings),
    "/v1/messages": Endpoint(routes_agents.messages, "anthropic"),
    "/v1/messages/count_tokens": Endpoint(routes_agents.count_tokens, "anthropic"),
    "/v1/responses": Endpoint(routes_agents.create_response),
}

#: the paths the ``malformed`` fault breaks
MALFORMED_PATHS = frozenset(p for p, e in ENDPOINTS.items() if e.malformed_fault)


def add_inference_routes(app: FastAPI, w: Worker) -> None:
    """``POST`` each path of :data:`ENDPOINTS` to its handler."""
    for path, ep in ENDPOINTS.items():
        _add(app, w, path, ep.serve)


def _add(app: FastAPI, w: Worker, path: str, serve) -> None:
    async def route(request: Request) -> Response:
        return await serve(request, w)

    app.add_api_route(path, route, methods=["POST"], name=serve.__name__)
