"""From the engine's items to an HTTP answer: collected into one body, or streamed as SSE.

:meth:`stack.worker.request_path.Worker.execute` yields ``{"token": id, "text": piece}``
items and a final ``{"done": meta}``. An API shape supplies either a body builder (it gets the
collected :class:`Completion`) or a :class:`StreamShape` (it turns each item into frames); this
module runs the loop, so an endpoint is parse, pick a shape, :func:`answer`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import Response

from stack.worker.http.encoding import error_response, event_stream, json_response

Items = AsyncIterator[dict]
"""What ``Worker.execute`` yields."""


@dataclass
class Completion:
    """A whole answer: the output text, its token ids and SGLang's ``meta_info``."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class StreamShape(Protocol):
    """One API's stream: the frames for each token, for the end of generation, and after it."""

    def on_token(self, token_id: int, text: str) -> list[bytes]: ...

    def on_done(self, meta: dict[str, Any]) -> list[bytes]: ...

    def on_close(self) -> list[bytes]: ...


def failure(meta: dict[str, Any]) -> tuple[int, str] | None:
    """(status, message) of a ``done`` meta that is a failure (an abort with a status code of
    400 or more, as SGLang's OpenAI server reads it), else None."""
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") != "abort":
        return None
    code = fr.get("status_code")
    if not isinstance(code, int) or code < 400:
        return None
    return code, str(fr.get("message") or "Generation aborted.")


async def collect(items: Items) -> Completion:
    """Every item of a request, gathered into one :class:`Completion`."""
    c = Completion()
    async for item in items:
        if "token" in item:
            c.text += item["text"]
            c.ids.append(item["token"])
        else:
            c.meta = item["done"]
    return c


async def frames(items: Items, shape: StreamShape, interval: int = 1) -> AsyncIterator[bytes]:
    """The SSE frames of a request, each sent as soon as its token is paced out; with
    ``interval`` > 1, after the first token the frames of ``interval`` tokens go out as one
    write (SGLang's ``--stream-interval``: the same frames, fewer writes for the worker, the
    router relaying them and the client)."""
    if interval <= 1:
        async for item in items:
            out = (
                shape.on_token(item["token"], item["text"])
                if "token" in item
                else shape.on_done(item["done"])
            )
            for frame in out:
                yield frame
        for frame in shape.on_close():
            yield frame
        return
    buf: list[bytes] = []
    n = 0
    first = True
    async for item in items:
        if "token" in item:
            buf += shape.on_token(item["token"], item["text"])
            n += 1
            if first or n >= interval:
                first, n = False, 0
                yield b"".join(buf)
                buf = []
        else:
            buf += shape.on_done(item["done"])
    buf += shape.on_close()
    if buf:
        yield b"".join(buf)


async def answer(
    items: Items, stream: StreamShape | None, body: Callable[[Completion], dict[str, Any]], interval: int = 1
) -> Response:
    """``stream`` given: an SSE answer (``interval``: tokens per write); otherwise the collected
    body as JSON, or SGLang's error body with the failure's status when the request failed
    (:func:`failure`; SGLang raises an HTTP error for a non-streamed abort with a status code)."""
    if stream is not None:
        return event_stream(frames(items, stream, interval))
    c = await collect(items)
    if (failed := failure(c.meta)) is not None:
        return error_response(failed[1], failed[0])
    return json_response(body(c))
