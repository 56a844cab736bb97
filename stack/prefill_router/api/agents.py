"""The agent APIs on the router: Anthropic Messages (``/v1/messages``, ``/count_tokens``) and
OpenAI Responses (``/v1/responses``).

They take the chat request path (:mod:`stack.prefill_router.api.dispatch`) and differ from
chat only here: in parsing (the body is converted to chat as SGLang converts it,
:mod:`stack.agent_apis`, for the features; the client's body itself goes to the workers,
which serve these endpoints themselves) and in the error envelope (:class:`Envelope`).
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from fastapi.responses import Response

from stack.agent_apis import AgentError
from stack.agent_apis.chat_step import chat_body
from stack.agent_apis.convert import convert
from stack.decode_router.pd import UpstreamError
from stack.prefill_router.api import errors
from stack.prefill_router.api.errors import ANTHROPIC_TYPES, anthropic_error
from stack.prefill_router.api.parse import Parsed
from stack.prefill_router.features import ClientError, FeatureExtractor, Features
from stack.prefill_router.session_hints import session_hint

JSON = "application/json"

#: endpoint name -> the API whose shapes it speaks
AGENT_ENDPOINTS = {"messages": "anthropic", "count_tokens": "anthropic", "responses": "responses"}

#: Anthropic's error types by status (its documented enum; 529: overloaded)


class Envelope:
    """How one API answers errors: OpenAI's shape (chat, completions, generate, Responses)."""

    #: the error frame(s) ending a stream that failed mid-way (None: the forwarder's OpenAI one)
    sse_error = None

    def client(self, status: int, message: str, param=None, code=None, type_=None) -> Response:
        return errors.error_response(
            status, message, type_ or "invalid_request_error", param=param, code=code
        )

    def no_worker(self, role: str, retry_after_s: int) -> Response:
        return errors.no_worker(role, retry_after_s)

    def overloaded(self, message: str, retry_after_s: int) -> Response:
        """The router's dispatch queue refused the request (full, or waited too long)."""
        return errors.error_response(
            503,
            message,
            "service_unavailable",
            code="overloaded",
            headers={"Retry-After": str(retry_after_s)},
        )

    def upstream(self, e: UpstreamError) -> Response:
        return errors.passthrough_error(e)

    def bad_gateway(self, message: str) -> Response:
        return errors.error_response(502, message, "upstream_error", code="upstream_error")

    def internal(self) -> Response:
        return errors.internal_error()

    def translate(self, resp: Response) -> Response:
        """An error answer made in OpenAI's shape (body reading), in this envelope."""
        return resp


def _anthropic_sse_error(message: str) -> bytes:
    ev = {"type": "error", "error": {"type": "api_error", "message": message}}
    return b"event: error\ndata: " + orjson.dumps(ev) + b"\n\n"


def _responses_sse_error(message: str) -> bytes:
    ev = {"type": "error", "code": "upstream_error", "message": message, "param": None, "sequence_number": -1}
    return b"event: error\ndata: " + orjson.dumps(ev) + b"\n\n"


class AnthropicEnvelope(Envelope):
    """Anthropic's shape: 400 ``invalid_request_error`` (a client's mistake), 413
    ``request_too_large``, 404 ``not_found_error``, 529 ``overloaded_error`` (no worker free),
    500 ``api_error`` (a bug, never a client's mistake)."""

    sse_error = staticmethod(_anthropic_sse_error)

    def client(self, status: int, message: str, param=None, code=None, type_=None) -> Response:
        if status == 422:  # Anthropic has no 422: a malformed request is a 400
            status = 400
        t = type_ if type_ in ANTHROPIC_TYPES.values() else None
        return anthropic_error(status, message, t)

    def no_worker(self, role: str, retry_after_s: int) -> Response:
        return anthropic_error(
            529,
            f"no {role} worker available",
            "overloaded_error",
            headers={"Retry-After": str(retry_after_s)},
        )

    def overloaded(self, message: str, retry_after_s: int) -> Response:
        return anthropic_error(529, message, "overloaded_error", headers={"Retry-After": str(retry_after_s)})

    def upstream(self, e: UpstreamError) -> Response:
        err, msg = errors.worker_error(e)
        t = err.get("type")
        type_ = t if t in ANTHROPIC_TYPES.values() else None
        status = 400 if e.status == 422 else e.status
        return anthropic_error(status, msg or e.message, type_)

    def bad_gateway(self, message: str) -> Response:
        return anthropic_error(502, message, "api_error")

    def internal(self) -> Response:
        return anthropic_error(500, "internal router error", "api_error")

    def translate(self, resp: Response) -> Response:
        try:
            msg = orjson.loads(resp.body)["error"]["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            msg = "invalid request"
        return self.client(resp.status_code, msg)


class ResponsesEnvelope(Envelope):
    """OpenAI's shape and statuses, as for chat; a failed stream ends with an ``error`` event."""

    sse_error = staticmethod(_responses_sse_error)


OPENAI = Envelope()
ANTHROPIC = AnthropicEnvelope()
RESPONSES = ResponsesEnvelope()


def envelope(endpoint: str) -> Envelope:
    api = AGENT_ENDPOINTS.get(endpoint)
    return ANTHROPIC if api == "anthropic" else RESPONSES if api == "responses" else OPENAI


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
) -> Parsed:
    """A valid agent request (the client's body goes to the workers unchanged), or
    :class:`AgentError`."""
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


def count_tokens_answer(f: Features) -> Response:
    """``/v1/messages/count_tokens``: SGLang's count (the rendered prompt's tokens)."""
    return Response(orjson.dumps({"input_tokens": f.prompt_tokens}), media_type=JSON)
