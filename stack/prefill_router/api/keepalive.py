"""Keep-alives for a streamed request whose answer is slow to start.

A load balancer or proxy between the client and the router closes a connection on which
nothing has moved for its idle timeout (60 s is common). Before its first token a streamed
request sends nothing: a long prompt's prefill, or a wait behind other prefills on the worker,
can outlast that timeout, and the client sees a cut connection instead of an answer.

So once a streamed request has left the router's dispatch queue (up to then an overload
answer can still be a proper 503 / 529 with ``Retry-After``, which the SDKs retry) and its
answer has not started within ``router.stream_keepalive_s``, the router answers 200 with
``text/event-stream`` and sends an SSE comment line (``: keep-alive``) every
``stream_keepalive_s`` until the answer's first chunk, then relays the answer as usual. SSE
comments are part of the event-stream format: the official OpenAI and Anthropic SDKs skip
them, as does any conforming SSE reader. Once the 200 is out, a failure that would have been
an error status (no worker left, the retry on another worker failed too) ends the stream with
an error event in the API's shape instead (as a failure mid-stream does).

:func:`kept_alive` decides between the two; :class:`KeepAliveStream` is the 200 answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import orjson
from fastapi.responses import Response, StreamingResponse

from stack.decode_router.sse import sse_error_frame
from stack.prefill_router.api.cancel import ReleasingStream
from stack.prefill_router.tracing import NullTrace, RequestTrace

Trace = RequestTrace | NullTrace

#: one SSE comment line: ignored by every SSE reader, enough to reset an idle timer
KEEPALIVE = b": keep-alive\n\n"


async def kept_alive(
    work: asyncio.Task[Response],
    left_queue: asyncio.Event,
    interval_s: float,
    sse_error: Callable[[str], bytes] | None,
    rt: Trace,
) -> Response:
    """``work``'s answer if it is ready within ``interval_s`` of the request leaving the
    dispatch queue (``left_queue``), else a :class:`KeepAliveStream` that waits for it."""
    if not work.done():
        waiter = asyncio.ensure_future(left_queue.wait())
        try:
            await asyncio.wait((work, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
    if not work.done():
        await asyncio.wait((work,), timeout=interval_s)
    if work.done():
        return work.result()
    return KeepAliveStream(work, interval_s, sse_error, rt)


class KeepAliveStream(StreamingResponse):
    """200 ``text/event-stream``: ``: keep-alive`` every ``interval_s`` until ``work`` (the
    request's hand-off and answer) is done, then its stream, or an error event in its place.
    However the stream ends, the work is settled: cancelled if it is still running (its own
    cleanup aborts the request on the workers and releases its booking), its answer's upstream
    side closed and booking released if it had one."""

    def __init__(
        self,
        work: asyncio.Task[Response],
        interval_s: float,
        sse_error: Callable[[str], bytes] | None,
        rt: Trace,
    ) -> None:
        self._work = work
        self._interval_s = interval_s
        self._frame = sse_error or sse_error_frame
        self._rt = rt
        super().__init__(self._body(), media_type="text/event-stream")

    async def _body(self) -> AsyncIterator[bytes]:
        while not self._work.done():
            done, _ = await asyncio.wait((self._work,), timeout=self._interval_s)
            if not done:
                yield KEEPALIVE
        resp = self._work.result()
        if isinstance(resp, StreamingResponse):
            async for chunk in resp.body_iterator:
                yield chunk
            return
        self._rt.end(resp.status_code, "failed after keep-alives")
        yield self._frame(error_message(resp))

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            w = self._work
            if not w.done():
                w.cancel()
                self._rt.end(499, "client gone")
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await w
            elif not w.cancelled() and w.exception() is None and isinstance(w.result(), ReleasingStream):
                await w.result().settle()


def error_message(resp: Response) -> str:
    """The message of an error answer in OpenAI's or Anthropic's shape (its status if none)."""
    try:
        err = orjson.loads(resp.body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        pass
    return f"the request failed with status {resp.status_code}"
