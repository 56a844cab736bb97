"""Event streams checked on their way to the client: each ``data:`` line one JSON value or
``[DONE]``, the first error event noticed (:func:`failure_of`), the end of the stream known
(``[DONE]`` or an API's final named event), and the error frame the router ends a failed
stream with."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

#: named events that end a stream with no ``[DONE]`` after them: Anthropic Messages and
#: OpenAI Responses (both as SGLang streams them)
END_EVENTS = (
    b"event: message_stop",
    b"event: response.completed",
    b"event: response.incomplete",
    b"event: response.failed",
)


def ends_stream(chunk: bytes) -> bool:
    """True when an event-stream chunk carries the final ``[DONE]`` event (or an API's final
    named event)."""
    return b"data: [DONE]" in chunk or any(e in chunk for e in END_EVENTS)


class Malformed(Exception):
    pass


_SSE_MAX_EVENT = 16 << 20


class SSECheck:
    """Passes an event stream on event by event, checking every ``data:`` line (one JSON value or
    ``[DONE]``, SGLang's and OpenAI's framing). ``feed`` returns the complete events so far and
    raises ``ValueError`` on a malformed one; ``end`` checks what is left. A stream with CR line
    ends is passed through unchecked. ``failed``: (status, message) of the first error event
    seen (:func:`failure_of`), else None."""

    __slots__ = ("buf", "done", "raw", "failed")

    def __init__(self) -> None:
        self.buf = b""
        self.done = False
        self.raw = False
        self.failed: tuple[int, str] | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self.raw:
            return chunk
        buf = self.buf + chunk if self.buf else chunk
        if b"\r" in chunk:
            self.raw, self.buf = True, b""
            return buf
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            if len(buf) > _SSE_MAX_EVENT:
                raise ValueError("event too large")
            self.buf = buf
            return b""
        out, self.buf = buf[: cut + 2], buf[cut + 2 :]
        self._check(out)
        return out

    def end(self) -> bytes:
        rest, self.buf = self.buf, b""
        if not self.raw and rest.strip():
            self._check(rest)
        return rest

    def _check(self, events: bytes) -> None:
        for line in events.split(b"\n"):
            if line.startswith(b"event:"):
                if any(line.rstrip() == e for e in END_EVENTS):
                    self.done = True
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                else:
                    obj = orjson.loads(payload)  # JSONDecodeError is a ValueError
                    if self.failed is None and (b'"error' in payload or b'"abort"' in payload):
                        self.failed = failure_of(obj)


def failure_of(event: object) -> tuple[int, str] | None:
    """(status, message) of an event that reports the request failed, else None: an OpenAI
    ``{"error": {...}}`` event (SGLang 0.5.23 streams one when a request aborts with a status
    code, e.g. a PD hand-off's bootstrap timeout), an Anthropic ``{"type": "error"}`` event, or
    a native ``/generate`` event whose ``meta_info.finish_reason`` is an abort with a status code
    of 400 or more (a client's own abort has none)."""
    if not isinstance(event, dict):
        return None
    err = event.get("error")
    if isinstance(err, dict) and event.get("type") in (None, "error"):
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, str(err.get("message") or "worker error")
    meta = event.get("meta_info")
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(fr, dict) and fr.get("type") == "abort":
        code = fr.get("status_code")
        if isinstance(code, int) and 400 <= code < 600:
            return code, str(fr.get("message") or "aborted")
    return None


async def checked(it, sse: SSECheck) -> AsyncIterator[bytes]:
    async for chunk in it:
        try:
            out = sse.feed(chunk)
        except ValueError:
            raise Malformed("worker sent a malformed event") from None
        if out:
            yield out
    try:
        out = sse.end()
    except ValueError:
        raise Malformed("worker sent a malformed event") from None
    if out:
        yield out
    if not sse.done and not sse.raw:
        raise Malformed("worker's stream ended without [DONE]")


def sse_error_frame(message: str) -> bytes:
    """An error event, then ``[DONE]`` (as SGLang ends a failed stream): OpenAI's shape."""
    err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"
