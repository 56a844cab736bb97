"""The router's inference endpoints, one table: each path's name, body parser, error envelope and
what becomes of it (forwarded to the workers' same path, with or without a decode half, or
answered by the router itself).

A new SGLang endpoint is one :class:`Endpoint` in :data:`ENDPOINTS` plus its parser (a body
in, a :class:`~stack.prefill_router.api.parse.Parsed` out, or a
:class:`~stack.prefill_router.errors.ClientError`); the request path
(:mod:`stack.prefill_router.api.inference`) and the app (:mod:`stack.prefill_router.api.app`)
read everything else from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from fastapi.responses import Response

from stack.prefill_router.api.agents import count_tokens_answer, parse_agent
from stack.prefill_router.api.errors import ANTHROPIC, OPENAI, RESPONSES, Envelope
from stack.prefill_router.api.parse import Parsed, parse_embeddings, parse_inference
from stack.prefill_router.features import FeatureExtractor

#: (extractor, endpoint name, body, raw body, headers, context length, needs_features) -> Parsed
Parser = Callable[[FeatureExtractor, str, dict, bytes, Mapping[str, str], int, bool], Parsed]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference endpoint of the router."""

    #: the endpoint's name, as counted in ``smetric_requests`` and as its parser knows it
    name: str
    #: the body's shape: its parser
    parse: Parser
    #: the API its errors speak
    envelope: Envelope
    #: answered by the router from the parsed request, never forwarded (None: forwarded to the
    #: workers on the same path)
    local: Callable[[Parsed], Response] | None = None
    #: under PD, whether a decode worker takes part (False: the request goes to a prefill
    #: worker alone, with no bootstrap fields; a colocated pool never has one)
    decode: bool = True
    #: how the request's SGLang ``priority`` travels (``router.dispatch.sglang_priority``): a
    #: body field, the ``x-override-priority`` header, or not at all
    priority: Literal["body", "header"] | None = "body"
    #: its ``model`` names a model the router must serve (router.models; SGLang's native
    #: ``/generate`` has no model field)
    checks_model: bool = True


#: path -> endpoint
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint("chat", parse_inference, OPENAI),
    "/v1/completions": Endpoint("completions", parse_inference, OPENAI),
    "/generate": Endpoint("generate", parse_inference, OPENAI, checks_model=False),
    # no decode half (a prefill worker alone under PD); SGLang's embedding request model has
    # no ``priority`` field
    "/v1/embeddings": Endpoint("embeddings", parse_embeddings, OPENAI, decode=False, priority=None),
    # agent APIs (stack.prefill_router.api.agents): Anthropic Messages, OpenAI Responses.
    # SGLang's Anthropic request model has no ``priority`` field: the header carries it
    "/v1/messages": Endpoint("messages", parse_agent, ANTHROPIC, priority="header"),
    "/v1/messages/count_tokens": Endpoint("count_tokens", parse_agent, ANTHROPIC, local=count_tokens_answer),
    "/v1/responses": Endpoint("responses", parse_agent, RESPONSES),
}

#: endpoint name -> its envelope
_BY_NAME = {e.name: e.envelope for e in ENDPOINTS.values()}


def envelope(name: str) -> Envelope:
    """The error envelope of the endpoint called ``name`` (OpenAI's for any other name)."""
    return _BY_NAME.get(name, OPENAI)
