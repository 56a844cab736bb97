"""The agent APIs on the router: Anthropic Messages (``/v1/messages``, ``/count_tokens``) and
OpenAI Responses (``/v1/responses``).

They take the chat request path (:mod:`stack.prefill_router.api.inference`) and differ from
chat only in parsing (here: the body is converted to chat as SGLang converts it,
:mod:`stack.agent_apis`, for the features; the client's body itself goes to the workers,
which serve these endpoints themselves) and in their error envelope
(:mod:`stack.prefill_router.api.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from fastapi.responses import Response

from stack.agent_apis import AgentError
from stack.agent_apis.chat_step import chat_body
from stack.agent_apis.convert import convert
from stack.prefill_router.api.errors import JSON
from stack.prefill_router.api.parse import Parsed
from stack.prefill_router.errors import ClientError
from stack.prefill_router.features import FeatureExtractor, Features
from stack.prefill_router.session_hints import session_hint

#: endpoint name -> the API whose shapes it speaks
AGENT_ENDPOINTS = {"messages": "anthropic", "count_tokens": "anthropic", "responses": "responses"}


def agent_features(extractor: FeatureExtractor, api: str, body: dict, count_only: bool = False) -> Features:
    """Tokens, block hashes, turn and est_hit of an agent request, rendered as SGLang renders
    it (``AgentError`` for a request SGLang refuses, or a template that cannot render it)."""
    tmpl = extractor.tok.template_src if extractor.tok is not None else None
    req = convert(api, body, tmpl, count_only)
    try:
        try:
            return extractor.chat(chat_body(req, tmpl))
        except ClientError:
            if not req.tools:  # SGLang retries once with the bare functions as tools
                raise
            return extractor.chat(chat_body(req, tmpl, flat=True))
    except ClientError as e:
        raise AgentError(e.message, e.param or "messages") from None


def parse_agent(
    extractor: FeatureExtractor,
    endpoint: str,
    body: dict,
    raw: bytes,
    headers: Mapping[str, str],
    context_length: int,
    needs_features: bool = True,
) -> Parsed:
    """A valid agent request (the client's body goes to the workers unchanged), or
    :class:`AgentError` (``needs_features``: unused, an agent body is always rendered)."""
    api = AGENT_ENDPOINTS[endpoint]
    f = agent_features(extractor, api, body, endpoint == "count_tokens")
    if endpoint != "count_tokens" and f.prompt_tokens >= context_length:
        raise AgentError(
            f"prompt is too long: {f.prompt_tokens} tokens, the model's context length is {context_length}",
            "messages" if api == "anthropic" else "input",
        )
    sid, src = session_hint(headers, body)
    f.session_id = sid
    return Parsed(body, raw, f, bool(body.get("stream")), src)


def count_tokens_answer(p: Parsed) -> Response:
    """``/v1/messages/count_tokens``: SGLang's count (the rendered prompt's tokens)."""
    return Response(orjson.dumps({"input_tokens": p.features.prompt_tokens}), media_type=JSON)
