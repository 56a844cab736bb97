"""Calls to the workers: the pooled HTTP session, the answer handed to the client
(:class:`Upstream`), a worker's failure (:class:`UpstreamError`) and ``/abort_request``.

Upstream calls use one pooled ``aiohttp.ClientSession`` (measured here at ~0.15 ms of CPU
per call against ~0.55 ms for httpx). A call that meets a pooled connection the worker had
already closed (:func:`stale`) is sent once more on a fresh connection before it fails
(:meth:`stack.decode_router.handoff.PDForwarder.post`): only a fresh call's failure counts
against a worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson

from stack.pool import Worker

log = logging.getLogger("stack.decode_router")


class UpstreamError(Exception):
    """A worker failed. ``retryable``: a server-side failure (connect error, 5xx, broken
    stream, an error event before the first token) rather than the worker rejecting the
    client's request (4xx). ``pair``: the decode half failed while its prefill twin had not
    answered yet (SGLang's decode gives up waiting for the KV, its bootstrap timeout): the
    hand-off failed, not the decode worker (:meth:`~stack.prefill_router.routed.Routed.failed`)."""

    def __init__(
        self,
        role: str,
        worker: Worker,
        message: str,
        status: int = 502,
        body: bytes | None = None,
        retryable: bool = True,
        connect: bool = False,
        pair: bool = False,
    ):
        super().__init__(message)
        self.role = role
        self.worker = worker
        self.message = message
        self.status = status
        self.body = body
        self.retryable = retryable
        self.connect = connect
        self.pair = pair


@dataclass
class Upstream:
    """What the client gets: status, content type, the first chunk and the rest."""

    status: int
    content_type: str
    first: bytes | None = None
    rest: AsyncIterator[bytes] | None = None
    #: a streamed answer's teardown when ``rest`` is dropped before it ran (the client left
    #: between the first chunk and the stream's start): closes the upstream calls and aborts
    #: the request on its workers; a no-op once the stream has ended
    abandon: Callable[[], None] | None = None


HOP = {"content-type": "application/json"}
NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
#: seconds a pooled connection to a worker is reused for: under the 5 s after which uvicorn
#: (SGLang's server, and the emulator's) closes an idle one, so the router lets go first
POOL_KEEPALIVE_S = 4.0


def stale(e: BaseException) -> bool:
    """Whether a call failed the way a call on a pooled connection the worker had already
    closed fails (disconnected or reset before any answer; a refused connect is not one): it
    is sent once more on a fresh connection before it counts against the worker."""
    return isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError) and not isinstance(
        e, aiohttp.ClientConnectorError
    )


def make_session(
    request_timeout_s: float = 600.0,
    connect_timeout_s: float = 3.0,
    max_connections: int = 4096,
    headers: dict[str, str] | None = None,
    fresh: bool = False,
) -> aiohttp.ClientSession:
    """The pooled upstream session (call inside the running event loop). ``headers``: sent with
    every call (hand-offs, health checks, load polls): the workers' API key
    (:func:`stack.prefill_router.auth.worker_headers`). ``fresh``: every call on a new
    connection, closed after it (the retry of a call that met a stale pooled one)."""
    if fresh:
        conn = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, force_close=True)
    else:
        conn = aiohttp.TCPConnector(
            limit=max_connections,
            limit_per_host=0,
            keepalive_timeout=POOL_KEEPALIVE_S,
            enable_cleanup_closed=True,
        )
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(
        connector=conn,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        headers=headers,
    )


async def abort(session: aiohttp.ClientSession, w: Worker, rid, headers: dict | None = None) -> None:
    """Best-effort ``/abort_request`` (SGLang's body ``{"rid": ...}``) on a worker (never
    raises). ``headers``: the request's headers (default ``HOP``; with worker keys,
    :meth:`PDForwarder.abort` adds the workers' admin key)."""
    rids = rid if isinstance(rid, list) else [rid]
    for r in rids:
        try:
            async with session.post(
                w.url + "/abort_request",
                data=orjson.dumps({"rid": r}),
                headers=headers or HOP,
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as resp:
                await resp.read()
                if resp.status in (401, 403):
                    log.warning(
                        "abort of %s on %s refused (%d): set router.auth.worker_admin_api_key_env to "
                        "the workers' --admin-api-key",
                        r,
                        w.url,
                        resp.status,
                    )
        except Exception:  # noqa: BLE001 - best effort
            pass


def unreachable(role: str, w: Worker, e: BaseException) -> UpstreamError:
    """The failure of a call that got no answer from ``w`` (``connect``: it never connected)."""
    connect = isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError)
    return UpstreamError(role, w, f"{role} worker unreachable: {type(e).__name__}", 502, None, True, connect)


def status_error(role: str, w: Worker, status: int, body: bytes) -> UpstreamError:
    """The failure of a call ``w`` answered with a non-200 ``status`` (retryable: 5xx, 429)."""
    retryable = status >= 500 or status == 429
    return UpstreamError(role, w, f"{role} worker answered {status}", status, body, retryable)
