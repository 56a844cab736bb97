"""SGLang PD hand-off: bootstrap fields, concurrent POSTs, stream decode's answer.

Protocol (as SGLang's own router drives it): copy the body and add ``bootstrap_host``
(the prefill worker's host), ``bootstrap_port`` (its bootstrap port) and
``bootstrap_room`` (a random int in [0, 2^63-1], unique per request; lists for batched
bodies); POST the same body to the prefill and the decode worker on the same path,
concurrently; return or stream decode's answer and drain prefill's. When one side fails
the other would wait for its 300 s timeout, so the twin is aborted (``/abort_request``
with the request's ``rid``, which the router sets when the client did not).

With no decode worker (colocated pools) the request goes to the prefill worker alone.

The parts: what both workers receive (:mod:`.bodies`), the calls to them (:mod:`.upstream`),
the prefill half's timings (:mod:`.prefill_meta`), the stream checks (:mod:`.sse`); the
decode worker itself is chosen in :mod:`.decode_choice`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from stack.decode_router.bodies import RoomAllocator, pd_body
from stack.decode_router.prefill_meta import KEEP_BYTES, PrefillObserver, answer_meta, meta_request
from stack.decode_router.sse import Malformed, SSECheck, checked, ends_stream, sse_error_frame
from stack.decode_router.upstream import (
    HOP,
    NET_ERRORS,
    Upstream,
    UpstreamError,
    abort,
    stale,
    status_error,
    unreachable,
)
from stack.pool import Worker

log = logging.getLogger("stack.decode_router")


@dataclass(slots=True)
class HandOff:
    """The inputs of one PD hand-off (:meth:`PDForwarder.forward`)."""

    path: str  #: the endpoint's path, the same on both workers
    raw: bytes  #: the client's body as received
    body: dict  #: the same, parsed
    prefill: Worker
    decode: Worker | None  #: None: a colocated pool (the prefill worker answers alone)
    #: called once prefill's answer is in (PD), or with the answer (colocated)
    on_prefill_done: Callable[[], None]
    #: request headers both workers get
    headers: dict | None = None
    #: False: the answer is read whole and must be JSON; True: an event stream checked event by
    #: event; None: bytes pass through unchecked
    stream: bool | None = None
    #: the error frame(s) for a failure mid-stream, in the client API's shape (None: OpenAI's
    #: ``data: {"error": ...}`` then ``[DONE]``)
    sse_error: Callable[[str], bytes] | None = None
    #: body fields both workers get on top of the client's (:func:`pd_body`), e.g. ``priority``
    extra: dict | None = None
    #: (prefill's, decode's) own headers on top, each worker's W3C ``traceparent``
    #: (:mod:`stack.prefill_router.tracing`; with no decode worker, the first)
    trace_headers: tuple[dict, dict] | None = None
    #: called with the prefill worker's own timing of the prefill half, where the observer
    #: read one (the request's record: :mod:`stack.prefill_router.record`)
    on_prefill_timed: Callable[[Any], None] | None = None


class Counts(Protocol):
    """A counter (a prometheus ``Counter``)."""

    def inc(self, amount: float = 1) -> None: ...


async def _drain(
    post: Callable[[str, bytes, dict], Awaitable[aiohttp.ClientResponse]],
    w: Worker,
    path: str,
    data: bytes,
    headers: dict,
    keep: bool = False,
) -> bytes:
    """POST to the prefill worker (``post``: :meth:`PDForwarder.post`) and read its whole
    answer; raise on failure. ``keep``: return the answer (its first ``KEEP_BYTES``), else b""."""
    kept: list[bytes] = []
    size = 0
    try:
        async with await post(w.url + path, data, headers) as r:
            if r.status != 200:
                raise status_error("prefill", w, r.status, await r.content.read(65536))
            async for chunk in r.content.iter_any():
                if keep and size < KEEP_BYTES:
                    kept.append(chunk)
                    size += len(chunk)
    except UpstreamError:
        raise
    except NET_ERRORS as e:
        raise unreachable("prefill", w, e) from None
    return b"".join(kept)


class PDForwarder:
    """SGLang's PD hand-off over ``session`` (pooled); ``fresh``: the session whose calls each
    take a new connection, for the one retry of a call that met a stale pooled connection
    (None: no retry). ``observer``: reads each prefill half's timing (router.cost_model
    observe | learn); ``stale_retries``: counts the calls retried on a fresh connection;
    ``stream_errors``: counts streamed answers that ended with an error event after their first
    token (a worker's own, passed on, or the router's when a worker failed mid-stream). None:
    not read, not counted."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        abort_headers: dict[str, str] | None = None,
        fresh: aiohttp.ClientSession | None = None,
        observer: PrefillObserver | None = None,
        stale_retries: Counts | None = None,
        stream_errors: Counts | None = None,
    ) -> None:
        self.session = session
        self.fresh = fresh
        self.stale_retries = stale_retries
        self.stream_errors = stream_errors
        self.rooms = RoomAllocator()
        self._background: set[asyncio.Task] = set()
        #: headers of ``/abort_request`` calls: SGLang takes only its ``--admin-api-key`` there
        #: when one is set (else its ``--api-key``)
        self.abort_headers = {**HOP, **abort_headers} if abort_headers else HOP
        self.observer = observer

    async def post(self, url: str, data: bytes, headers: dict) -> aiohttp.ClientResponse:
        """POST on a pooled connection; when the worker's side cut it before any answer (a
        connection it had closed while idle, or while the router stalled:
        :func:`stale`), once more on a fresh connection. Its headers are in when it returns."""
        try:
            return await self.session.post(url, data=data, headers=headers)
        except NET_ERRORS as e:
            if self.fresh is None or not stale(e):
                raise
            log.debug("call to %s met a stale connection (%r): retried on a fresh one", url, e)
        if self.stale_retries is not None:
            self.stale_retries.inc()
        return await self.fresh.post(url, data=data, headers=headers)

    # -- aborts (the request's work on the workers ends when nobody waits for it) -------------
    async def abort(self, w: Worker, rid) -> None:
        """``/abort_request`` for ``rid`` on ``w``, awaited (never raises)."""
        await abort(self.session, w, rid, self.abort_headers)

    def abort_later(self, rid, *workers: Worker | None) -> None:
        """``/abort_request`` for ``rid`` on each of ``workers`` in background tasks: from a
        ``finally`` or an ``except CancelledError`` (the client left), where an ``await``
        could itself be cancelled before the abort is sent."""
        for w in workers:
            if w is not None:
                t = _spawn(self.abort(w, rid))
                self._background.add(t)
                t.add_done_callback(self._background.discard)

    def _abandoned(self, resp, p_task, prefill: Worker, decode: Worker | None, rid) -> None:
        """The hand-off was cancelled (the client left before the first chunk): the upstream
        calls are dropped and both workers told to abort the request, in the background."""
        if resp is not None:
            resp.close()
        if p_task is not None and not p_task.done():
            p_task.cancel()
        self.abort_later(rid, prefill, decode)

    async def forward(self, h: HandOff) -> Upstream:
        """Send one request (:class:`HandOff`); returns once decode's first chunk (or full
        answer) is in.

        Raises :class:`UpstreamError` when either side fails before that (the twin is
        aborted); after that, a prefill failure ends the stream with an error event.

        ``h.stream=False``: the whole answer is read and must be JSON (a malformed body is a
        retryable :class:`UpstreamError`, like a 5xx). ``True``: an event stream is forwarded
        event by event, each ``data:`` line checked (JSON or ``[DONE]``); a malformed or error
        first event is retryable, a later malformed one ends the stream with an error event
        (``h.sse_error``), and so does a stream that ends without ``[DONE]`` (or an API's final
        named event, e.g. ``message_stop``). ``None``: bytes pass through unchecked.
        """
        path, raw, body, prefill, decode = h.path, h.raw, h.body, h.prefill, h.decode
        on_prefill_done, headers, stream, trace_headers = (
            h.on_prefill_done,
            h.headers,
            h.stream,
            h.trace_headers,
        )
        hdrs = dict(HOP)
        if headers:
            hdrs.update(headers)
        p_hdrs = a_hdrs = hdrs
        if trace_headers is not None:
            p_hdrs = {**hdrs, **trace_headers[0]}
            a_hdrs = {**hdrs, **trace_headers[1]} if decode is not None else p_hdrs
        data, _room, rid = pd_body(raw, body, prefill if decode is not None else None, self.rooms, h.extra)
        answer = decode if decode is not None else prefill
        a_role = "decode" if decode is not None else "prefill"
        p_task: asyncio.Task | None = None
        if decode is not None:
            p_task = _spawn(self._prefill_half(prefill, path, data, body, p_hdrs, h.on_prefill_timed))

            def _done(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None:
                    on_prefill_done()

            p_task.add_done_callback(_done)
        resp = None
        try:
            d_task = _spawn(self.post(answer.url + path, data, a_hdrs))
            resp = await self._race(d_task, p_task, answer, a_role, prefill, decode, rid)
            ctype = resp.headers.get("content-type", "application/json")
            if resp.status != 200:
                try:
                    body_bytes = await resp.content.read(65536)
                except NET_ERRORS:
                    body_bytes = b""
                resp.release()
                err = status_error(a_role, answer, resp.status, body_bytes)
                if decode is not None:
                    err.pair = err.retryable and _pair_failed(p_task)
                    if p_task is not None:
                        p_task.cancel()
                    await self.abort(prefill, rid)
                raise err
            if stream is False:
                whole = _spawn(resp.read())
                first = await self._race(whole, p_task, answer, a_role, prefill, decode, rid)
                try:
                    orjson.loads(first)
                except orjson.JSONDecodeError:
                    await self._malformed(resp, p_task, prefill, decode, rid)
                    raise UpstreamError(
                        a_role, answer, f"{a_role} worker answered a malformed body"
                    ) from None
                resp.release()
                if decode is None:
                    on_prefill_done()
                elif not p_task.done():  # decode is done; prefill's answer drains in the background
                    self._background.add(p_task)
                    p_task.add_done_callback(self._background.discard)
                return Upstream(200, ctype, first=first, rest=_nothing())
            it = resp.content.iter_any().__aiter__()
            first_task = _spawn(_anext(it))
            first = await self._race(first_task, p_task, answer, a_role, prefill, decode, rid)
            sse = SSECheck() if stream and ctype.startswith("text/event-stream") else None
            if sse is not None:
                first = await self._first_event(
                    it, first, sse, resp, p_task, answer, a_role, prefill, decode, rid
                )
            if decode is None:
                on_prefill_done()
            end = _StreamEnd(self, resp, p_task, prefill, decode, rid)
            rest = self._rest(it, end, sse, h.sse_error)
            return Upstream(200, ctype, first=first, rest=rest, abandon=end)
        except asyncio.CancelledError:
            self._abandoned(resp, p_task, prefill, decode, rid)
            raise
        except BaseException:
            if resp is not None:
                resp.close()
            if p_task is not None and not p_task.done():
                p_task.cancel()
            raise

    async def _first_event(
        self, it, first, sse: SSECheck, resp, p_task, answer, a_role, prefill, decode, rid
    ):
        """The stream's first whole event(s), checked: a malformed one, or an error event (before
        any token, so nothing has reached the client), is a retryable :class:`UpstreamError`
        (the PD twin aborted); decode's error while prefill has not answered is the pair's."""
        more: bytes | None = first
        try:
            first = sse.feed(first)
            while not first and more:
                more = await self._race(_spawn(_anext(it)), p_task, answer, a_role, prefill, decode, rid)
                first = sse.feed(more) if more else sse.end()
        except ValueError:
            await self._malformed(resp, p_task, prefill, decode, rid)
            raise UpstreamError(a_role, answer, f"{a_role} worker sent a malformed event") from None
        if sse.failed is None:
            return first
        status, message = sse.failed
        pair = decode is not None and _pair_failed(p_task)
        await self._malformed(resp, p_task, prefill, decode, rid)
        raise UpstreamError(
            a_role,
            answer,
            f"{a_role} worker failed the request: {message}",
            status,
            first,
            retryable=status >= 500 or status == 429,
            pair=pair,
        )

    async def _prefill_half(
        self,
        prefill: Worker,
        path: str,
        data: bytes,
        body: dict,
        hdrs: dict,
        timed: Callable[[Any], None] | None = None,
    ) -> None:
        """The prefill half, drained; with an observer, sent :func:`meta_request` and its
        ``meta_info`` handed over, the observation it made to ``timed`` (a failure of either
        never fails the request)."""
        obs = self.observer
        if obs is None:
            await _drain(self.post, prefill, path, data, hdrs)
            return
        p_path, p_data = meta_request(path, data, body) or (path, None)
        ticket = obs.begin(prefill.url, p_data is not None)  # an unobserved prefill: in flight, no timing
        try:
            raw = await _drain(self.post, prefill, p_path, p_data or data, hdrs, keep=p_data is not None)
            if p_data is not None:
                try:
                    ob = obs.record(ticket, answer_meta(raw))
                    if ob is not None and timed is not None:
                        timed(ob)
                except Exception:  # noqa: BLE001 - learning never fails a request
                    log.exception("prefill observer")
        finally:
            obs.end(ticket)

    async def _malformed(self, resp, p_task, prefill, decode, rid) -> None:
        resp.close()
        if decode is not None:
            if p_task is not None and not p_task.done():
                p_task.cancel()
            await self.abort(prefill, rid)

    async def _race(self, task, p_task, answer, a_role, prefill, decode, rid):
        """Await ``task`` unless the prefill side fails first (then abort decode)."""
        pending = {task}
        if p_task is not None and not p_task.done():
            pending.add(p_task)
        while True:
            if p_task is not None and p_task.done() and p_task.exception() is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    got = await task
                    if isinstance(got, aiohttp.ClientResponse):
                        got.close()
                await self.abort(decode, rid)
                raise p_task.exception()
            if task.done():
                break
            try:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                _drop(task)
                raise
            pending -= done
        try:
            return task.result()
        except StopAsyncIteration:
            return b""
        except NET_ERRORS as e:
            if decode is not None:
                if p_task is not None and not p_task.done():
                    p_task.cancel()
                await self.abort(prefill, rid)
            raise unreachable(a_role, answer, e) from None

    async def _rest(self, it, end: _StreamEnd, sse=None, sse_error=None) -> AsyncIterator[bytes]:
        """Decode's stream after its first chunk, watching the prefill side while it runs;
        ``end`` settles the upstream side when the stream ends, fails or is dropped."""
        err_frame = sse_error or sse_error_frame
        p_task, decode, rid = end.p_task, end.decode, end.rid
        counted = False
        ok = False
        aborted = False
        if sse is not None:
            it = checked(it, sse)
        finished = False  # decode's answer is complete ([DONE] forwarded)
        try:
            while p_task is not None and not p_task.done():
                nxt = _spawn(_anext(it))
                try:
                    await asyncio.wait({nxt, p_task}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:
                    nxt.cancel()
                    raise
                if (
                    not nxt.done()
                    and not p_task.cancelled()
                    and p_task.exception() is not None
                    and not finished
                ):
                    # prefill failed while decode still waits: decode may never get the KV
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    await self.abort(decode, rid)
                    aborted = True
                    self._stream_error()
                    counted = True
                    yield err_frame("prefill worker failed mid-request")
                    return
                try:
                    chunk = await nxt  # decode's chunk first, when both ended at once
                except StopAsyncIteration:
                    ok = True
                    return
                finished = finished or ends_stream(chunk)
                yield chunk
            async for chunk in it:
                yield chunk
            ok = True
        except NET_ERRORS:
            self._stream_error()
            counted = True
            yield err_frame("decode worker failed mid-stream")
        except Malformed as e:
            self._stream_error()
            counted = True
            yield err_frame(str(e))
        finally:
            if sse is not None and sse.failed is not None and not counted:
                self._stream_error()  # the worker's own error event, passed on
            end(ok, aborted)

    def _stream_error(self) -> None:
        if self.stream_errors is not None:
            self.stream_errors.inc()


class _StreamEnd:
    """Settles the upstream side of one streamed answer, once: the decode response released
    (complete) or closed, prefill's answer drained in the background (complete) or cancelled,
    and, unless the stream completed, both workers told to abort the request (in background
    tasks: this runs in a ``finally`` of a stream the client may have left, where an awaited
    call would be cancelled). Called by the stream when it ends, and by the router when the
    stream is dropped before it ever ran (:attr:`Upstream.abandon`)."""

    __slots__ = ("fwd", "resp", "p_task", "prefill", "decode", "rid", "settled")

    def __init__(self, fwd: PDForwarder, resp, p_task, prefill: Worker, decode: Worker | None, rid) -> None:
        self.fwd, self.resp, self.p_task = fwd, resp, p_task
        self.prefill, self.decode, self.rid = prefill, decode, rid
        self.settled = False

    def __call__(self, ok: bool = False, aborted: bool = False) -> None:
        if self.settled:
            return
        self.settled = True
        if ok:
            self.resp.release()
        else:
            self.resp.close()
        p_task = self.p_task
        if p_task is not None and not p_task.done():
            if ok:  # decode is done; let prefill's answer drain in the background
                self.fwd._background.add(p_task)
                p_task.add_done_callback(self.fwd._background.discard)
            else:
                p_task.cancel()
        if not ok and not aborted:
            self.fwd.abort_later(self.rid, self.decode, self.prefill)


def _pair_failed(p_task: asyncio.Task | None) -> bool:
    """Whether the decode half failed while its prefill twin had not answered yet."""
    return p_task is not None and not p_task.done()


def _drop(task: asyncio.Task) -> None:
    """Cancel an upstream call nobody waits for any more (a response it already got is closed)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        got = task.result()
        if isinstance(got, aiohttp.ClientResponse):
            got.close()


async def _anext(it):
    return await it.__anext__()


def _spawn(coro) -> asyncio.Task:
    """A task whose exception is always retrieved, also when nobody awaits it any more (the
    client went away, or it drains in the background): no "exception was never retrieved"."""
    t = asyncio.create_task(coro)
    t.add_done_callback(_retrieve)
    return t


def _retrieve(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.debug("background task ended with %r", t.exception())


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover
