"""Work that stops when the client leaves.

A client can leave at any point of a request's life, and the engine work it started must end
with it, on both workers of a PD pair:

- while its body is tokenized off the loop: the job is dropped
  (:meth:`~stack.prefill_router.offload.FeaturePool.run`);
- while it waits in the router's dispatch queue: it gives up its place
  (:meth:`~stack.prefill_router.queue.LiveQueue.route`);
- after it was sent, before the first token (prefill running or queued on the worker, decode
  waiting for the KV, or a whole non-streamed answer being generated): :func:`unless_gone`
  cancels the hand-off, and the forwarder sends ``/abort_request`` to the prefill and the
  decode worker (:meth:`~stack.decode_router.handoff.PDForwarder.forward`);
- mid-stream: the stream's teardown aborts the request on both workers
  (:class:`~stack.decode_router.handoff.PDForwarder`'s stream end), and :class:`ReleasingStream`
  makes sure it runs (and the booking is released) even when the stream is dropped before
  its first chunk was sent.

The aborts run in background tasks: the code that notices the client left runs under a
cancellation, where an awaited call would itself be cancelled before it reached the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from stack.decode_router.upstream import Upstream
from stack.prefill_router.errors import Cancelled

T = TypeVar("T")


async def unless_gone(work: Coroutine[Any, Any, T], gone: Callable[[], Awaitable[None]] | None) -> T:
    """``work``'s result, unless the client leaves first (``gone()`` returns: the next ASGI
    message is ``http.disconnect``): then ``work`` is cancelled (its own cleanup aborts what
    it started on the workers) and :class:`~stack.prefill_router.errors.Cancelled` is raised.
    ``gone`` None: ``work`` alone.

    ``work`` runs in the calling task (one watcher task per request, no ``asyncio.wait``: a
    few microseconds); a client that leaves cancels that task, and the cancellation is turned
    into :class:`Cancelled` here."""
    if gone is None:
        return await work
    me = asyncio.current_task()
    state = [False, False]  # [the client left, the work is over]

    def on_gone(t: asyncio.Future) -> None:
        if not state[1] and not t.cancelled() and t.exception() is None:
            state[0] = True
            me.cancel()

    watch = asyncio.ensure_future(gone())
    watch.add_done_callback(on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if not state[0]:
            raise
        uncancel = getattr(me, "uncancel", None)  # 3.11+: this cancellation is handled here
        if uncancel is not None:
            uncancel()
        raise Cancelled() from None
    finally:
        state[1] = True
        watch.cancel()


class ReleasingStream(StreamingResponse):
    """A streamed answer whose upstream side is settled and whose booking is released however
    the stream ends: completed, left by the client mid-way, or dropped before its first chunk
    went out (then the body iterator never ran, and its own ``finally`` never will)."""

    def __init__(
        self, content: AsyncIterator[bytes], up: Upstream, release: Callable[[], None], **kw
    ) -> None:
        super().__init__(content, **kw)
        self._up = up
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.settle()

    async def settle(self) -> None:
        """Close the upstream side, release the booking, close the body (each once; also
        called by a :class:`~stack.prefill_router.api.keepalive.KeepAliveStream` relaying it)."""
        if self._up.abandon is not None:
            self._up.abandon()
        self._release()
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # still running: its own finally settles it
                await aclose()
