"""Bytes on the wire: JSON bodies, SGLang's error body, and server-sent-event frames.

SGLang and OpenAI stream ``data: <json>`` frames closed by ``data: [DONE]``; an API that names
its events (Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses``) adds its ``event:`` frame
beside :func:`data_event`, so every API shape takes its framing from here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

SSE_DONE = b"data: [DONE]\n\n"
"""The terminator of SGLang's and OpenAI's streams."""


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` as JSON (orjson: fast, and the bytes every endpoint has always sent)."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_object(msg: str, status: int = 400) -> dict[str, Any]:
    """SGLang's error object (OpenAI-shaped: ``object: error`` with a message, type and code;
    the type is ``BadRequestError`` for a 400, else the status's name, as SGLang 0.5.23 names
    a failed request's, e.g. ``INTERNAL_SERVER_ERROR``)."""
    type_ = "BadRequestError" if status == 400 else _status_name(status)
    return {"object": "error", "message": msg, "type": type_, "param": None, "code": status}


def _status_name(status: int) -> str:
    try:
        return HTTPStatus(status).name
    except ValueError:
        return str(status)


def error_response(msg: str, status: int = 400) -> Response:
    """SGLang's error body (:func:`error_object`) with ``status``."""
    return json_response(error_object(msg, status), status)


def data_event(obj: Any) -> bytes:
    """An unnamed SSE frame: ``data: <json>``."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event_stream(frames: AsyncIterator[bytes]) -> StreamingResponse:
    """A streamed ``text/event-stream`` answer."""
    return StreamingResponse(frames, media_type="text/event-stream")
