"""SGLang's native generation endpoint, ``POST /generate``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from stack.worker.http.encoding import error_response
from stack.worker.http.parse import admit, parse_generate
from stack.worker.http.relay import answer
from stack.worker.http.shapes.sglang import GenerateStream, generate_object
from stack.worker.request_path import Worker


async def generate(request: Request, w: Worker) -> Response:
    try:
        body, req = await admit(request, w, parse_generate)
    except (ValueError, TypeError) as ex:
        return error_response(str(ex))
    stream = GenerateStream(req) if body.get("stream") else None
    return await answer(w.execute(req), stream, generate_object, w.s.stream_interval)
