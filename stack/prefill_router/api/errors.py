"""Every error the router answers, in the client's API's shape (the router's one edge for errors).

- OpenAI's ``{"error": {message, type, param, code}}`` (chat, completions, ``/generate``,
  embeddings, Responses, and everything that is not an inference endpoint), so OpenAI
  clients show the message rather than failing to parse the body;
- Anthropic's ``{"type": "error", "error": {type, message}}`` (``/v1/messages``).

An :class:`Envelope` answers one API's errors (client mistakes, no worker, overloaded, a
worker's error, a bad gateway, the router's own failure, and the error frame ending a stream
that failed mid-way); :data:`OPENAI`, :data:`ANTHROPIC` and :data:`RESPONSES` are the three.
Which endpoint speaks which: the table in :mod:`stack.prefill_router.api.endpoints`.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from stack.decode_router.upstream import UpstreamError
from stack.prefill_router.errors import Cancelled, ClientError

log = logging.getLogger("stack.router")

JSON = "application/json"


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None
) -> Response:
    """An OpenAI-shaped error answer (``code`` defaults to the status)."""
    body = {
        "error": {
            "message": message,
            "type": type_,
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return Response(orjson.dumps(body), status_code=status, media_type=JSON, headers=headers)


def client_error(e: ClientError) -> Response:
    """The answer to a request the client got wrong (4xx)."""
    return error_response(e.status, e.message, param=e.param, code=e.code)


def internal_error() -> Response:
    """The answer when the router itself failed (the cause is logged, never sent)."""
    return error_response(500, "internal router error", "server_error", code="internal_error")


def no_worker(role: str, retry_after_s: int) -> Response:
    """503 with ``Retry-After``: no healthy ``role`` worker can take the request now."""
    return error_response(
        503,
        f"no {role} worker available",
        "service_unavailable",
        code="no_worker",
        headers={"Retry-After": str(retry_after_s)},
    )


#: Anthropic's error type for each status (its API's envelope)
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str, type_: str | None = None, headers=None) -> Response:
    """``{"type": "error", "error": {"type", "message"}}`` with ``status``."""
    body = {
        "type": "error",
        "error": {"type": type_ or ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
    }
    return Response(orjson.dumps(body), status_code=status, media_type=JSON, headers=headers)


def worker_error(e: UpstreamError) -> tuple[dict, str | None]:
    """A worker's error answer read once for every envelope: its error object (``{"error":
    {...}}`` or a flat body; ``{}`` when not JSON) and its message (the object's ``message`` or
    ``detail``, else the body's first 500 bytes as text; None without a body)."""
    if not e.body:
        return {}, None
    try:
        obj = orjson.loads(e.body)
    except orjson.JSONDecodeError:
        obj = None
    err: dict = {}
    if isinstance(obj, dict):
        err = obj["error"] if isinstance(obj.get("error"), dict) else obj
    m = err.get("message") or err.get("detail")
    return err, m if isinstance(m, str) and m else e.body[:500].decode("utf-8", "replace")


def passthrough_error(e: UpstreamError) -> Response:
    """A worker rejected the request (4xx): give the client the worker's message, OpenAI-shaped."""
    err, msg = worker_error(e)
    type_ = err.get("type") if isinstance(err.get("type"), str) else "invalid_request_error"
    param = err.get("param") if isinstance(err.get("param"), str) else None
    code = err.get("code", e.status)
    return error_response(e.status, msg or e.message, type_, param=param, code=code)


class Envelope:
    """How one API answers errors: OpenAI's shape (chat, completions, generate, Responses)."""

    #: the error frame(s) ending a stream that failed mid-way (None: the forwarder's OpenAI one)
    sse_error = None

    def client(self, status: int, message: str, param=None, code=None, type_=None) -> Response:
        return error_response(status, message, type_ or "invalid_request_error", param=param, code=code)

    def no_worker(self, role: str, retry_after_s: int) -> Response:
        return no_worker(role, retry_after_s)

    def overloaded(self, message: str, retry_after_s: int) -> Response:
        """The router's dispatch queue refused the request (full, or waited too long)."""
        return error_response(
            503,
            message,
            "service_unavailable",
            code="overloaded",
            headers={"Retry-After": str(retry_after_s)},
        )

    def upstream(self, e: UpstreamError) -> Response:
        return passthrough_error(e)

    def bad_gateway(self, message: str) -> Response:
        return error_response(502, message, "upstream_error", code="upstream_error")

    def model_not_found(self, name: str) -> Response:
        """404: the request names a model the router does not serve (router.models)."""
        return self.client(
            404,
            f"The model {name[:200]!r} does not exist: GET /v1/models lists the models served",
            param="model",
            code="model_not_found",
        )

    def internal(self) -> Response:
        return internal_error()

    def translate(self, resp: Response) -> Response:
        """An error answer made in OpenAI's shape (body reading), in this envelope."""
        return resp

    # -- API keys and per-key limits (stack.prefill_router.api.gate) ---------------------------
    def unauthorized(self, message: str, code: str) -> Response:
        """401: no key, a malformed key header, or a key the router does not know (OpenAI
        answers ``invalid_request_error`` / ``invalid_api_key``)."""
        return error_response(
            401, message, "invalid_request_error", code=code, headers={"WWW-Authenticate": "Bearer"}
        )

    def rate_limited(self, message: str, reason: str, retry_after_s: int) -> Response:
        """429 with ``Retry-After``: the key is over a limit (OpenAI's ``type`` says which kind:
        ``requests`` or ``tokens``)."""
        return error_response(
            429,
            message,
            "tokens" if reason == "prompt_tokens" else "requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after_s)},
        )

    def header_too_large(self, message: str) -> Response:
        """431: a key header far longer than any key, refused before it is hashed."""
        return error_response(431, message, "invalid_request_error", code="header_too_large")


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
        err, msg = worker_error(e)
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

    def unauthorized(self, message: str, code: str) -> Response:
        return anthropic_error(401, message, "authentication_error")

    def rate_limited(self, message: str, reason: str, retry_after_s: int) -> Response:
        return anthropic_error(429, message, "rate_limit_error", headers={"Retry-After": str(retry_after_s)})

    def header_too_large(self, message: str) -> Response:
        return anthropic_error(431, message, "invalid_request_error")


class ResponsesEnvelope(Envelope):
    """OpenAI's shape and statuses, as for chat; a failed stream ends with an ``error`` event."""

    sse_error = staticmethod(_responses_sse_error)


OPENAI = Envelope()
ANTHROPIC = AnthropicEnvelope()
RESPONSES = ResponsesEnvelope()


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors (unknown path, wrong method, validation, exceptions) in the
    same shape as the router's."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException):
        if request.url.path.startswith("/v1/messages"):  # Anthropic's clients: Anthropic's envelope
            if exc.status_code == 404:
                return anthropic_error(404, f"no route {request.url.path}", "not_found_error")
            if exc.status_code == 405:
                return anthropic_error(405, f"method {request.method} not allowed on {request.url.path}")
            return anthropic_error(exc.status_code, str(exc.detail))
        if exc.status_code == 404:
            return error_response(404, f"no route {request.url.path}", "not_found_error", code="not_found")
        if exc.status_code == 405:
            return error_response(
                405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed"
            )
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, "invalid request", code="invalid_request")

    async def _gone(request: Request, exc: Exception):
        # the client left while its body was read: its doing, and nobody to answer
        log.debug("client gone while its body was read on %s", request.url.path)
        return Response(status_code=499)

    app.add_exception_handler(ClientDisconnect, _gone)
    app.add_exception_handler(Cancelled, _gone)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return internal_error()
