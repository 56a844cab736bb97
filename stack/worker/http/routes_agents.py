"""Agent APIs, as SGLang 0.5.23 serves them: ``/v1/messages`` (Anthropic Messages),
``/v1/messages/count_tokens`` and ``/v1/responses`` (OpenAI Responses, stateless).

A body is converted to chat as SGLang converts it (:mod:`stack.agent_apis`, the code the
router's features use), tokenized through the chat template and run on the shared request
path; the answer is built in the API's shape (:mod:`.shapes.anthropic`,
:mod:`.shapes.responses`). The PD fields ride in the body as for chat.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stack.agent_apis import AgentError
from stack.agent_apis.chat_step import ChatRequest, chat_body
from stack.agent_apis.convert import convert
from stack.worker.engine import GenParams
from stack.worker.http.encoding import error_response, json_response
from stack.worker.http.parse import bootstrap_fields, read_body
from stack.worker.http.relay import answer
from stack.worker.http.shapes import anthropic, responses
from stack.worker.http.tracing import annotate
from stack.worker.request import request_priority
from stack.worker.request_path import Worker
from stack.worker.tool_calls import forced_call


def _encode(
    w: Worker, api: str, body: dict[str, Any], count_only: bool = False
) -> tuple[ChatRequest, list[int]]:
    tok = w.engine.tokenizer
    tmpl = getattr(tok, "template_src", None)
    req = convert(api, body, tmpl, count_only)
    try:
        try:
            return req, tok.encode_chat(chat_body(req, tmpl))
        except ValueError:  # the template failed: SGLang retries with the bare functions
            if not req.tools:
                raise
            return req, tok.encode_chat(chat_body(req, tmpl, flat=True))
    except AgentError:
        raise
    except ValueError as ex:
        raise AgentError(str(ex)) from None


async def _admit(request: Request, w: Worker, api: str):
    t_arrive = time.monotonic()
    body = await read_body(request)
    chat, tokens = _encode(w, api, body)
    params = GenParams(
        max_new_tokens=chat.max_tokens, stop=list(chat.stop or []), ignore_eos=bool(body.get("ignore_eos"))
    )
    req = w.make_req(tokens, params, rid=body.get("rid"), t_arrive=t_arrive, **bootstrap_fields(body))
    try:  # SGLang's Anthropic request model has no priority field: the header only
        req.priority = request_priority({} if api == "anthropic" else body, request.headers)
    except ValueError as ex:
        raise AgentError(str(ex)) from None
    annotate(request.scope, req.rid, req.L, req.bootstrap_room)
    req.params.tool_call = forced_call(chat.tools, chat.tool_choice, w.s.tool_call_parser, req.rid, req.L)
    return body, req


async def messages(request: Request, w: Worker) -> Response:
    try:
        body, req = await _admit(request, w, "anthropic")
    except AgentError as ex:
        return anthropic.error_response(ex.message, ex.status, ex.type)
    except (ValueError, TypeError) as ex:
        return anthropic.error_response(str(ex))
    mid, model = f"msg_{req.rid}", body.get("model") or w.s.model
    call = req.params.tool_call
    stream = anthropic.MessageStream(mid, model, req.L, call) if body.get("stream") else None
    return await answer(
        w.execute(req), stream, partial(anthropic.message_object, mid, model, call=call), w.s.stream_interval
    )


async def count_tokens(request: Request, w: Worker) -> Response:
    try:
        body = await read_body(request)
        _, tokens = _encode(w, "anthropic", body, count_only=True)
    except AgentError as ex:
        return anthropic.error_response(ex.message, ex.status, ex.type)
    except (ValueError, TypeError) as ex:
        return anthropic.error_response(str(ex))
    return json_response({"input_tokens": len(tokens)})


async def create_response(request: Request, w: Worker) -> Response:
    try:
        body, req = await _admit(request, w, "responses")
    except AgentError as ex:
        return error_response(ex.message, ex.status)
    except (ValueError, TypeError) as ex:
        return error_response(str(ex))
    h = responses.head(req.rid, body.get("model") or w.s.model, body, req.params.tool_call)
    stream = responses.ResponseStream(h) if body.get("stream") else None
    return await answer(w.execute(req), stream, partial(responses.completed_object, h), w.s.stream_interval)
