"""Bytes on the wire: JSON bodies, SGLang's error body, and server-sent-event frames.

SGLang and OpenAI stream ``data: <json>`` frames closed by ``data: [DONE]``; an API that names
its events (Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses``) adds its ``event:`` frame
beside :func:`data_event`, so every API shape takes its framing from here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

SSE_DONE = b"data: [DONE]\n\n"
"""The terminator of SGLang's and OpenAI's streams."""


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` as JSON (orjson: fast, and the bytes every endpoint has always sent)."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_response(msg: str, status: int = 400) -> Response:
    """SGLang's error body (OpenAI-shaped: ``object: error`` with a message and code)."""
    return json_response(
        {"object": "error", "message": msg, "type": "BadRequestError", "code": status}, status
    )


def data_event(obj: Any) -> bytes:
    """An unnamed SSE frame: ``data: <json>``."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event_stream(frames: AsyncIterator[bytes]) -> StreamingResponse:
    """A streamed ``text/event-stream`` answer."""
    return StreamingResponse(frames, media_type="text/event-stream")
