"""The router's front door: what one client connection may hold of the server before (and
while) its request reaches the app (``router.front_door``; docs/router.md, "The front door").

uvicorn's httptools protocol with checks on the bytes as they arrive, before the HTTP parser
sees them (httptools joins a header's pieces by copying, so a 64 MB header cost the event
loop seconds; issue 41):

- the request head (request line and headers) is at most ``max_header_bytes`` bytes and
  ``max_headers`` lines: past either, 431 and the connection is closed at once;
- the head arrives within ``header_timeout_s`` of the connection's start (or of the first
  byte of a kept-alive connection's next request): else 408 and closed;
- the body arrives within ``body_timeout_s`` of the end of the head: else 408 in the
  endpoint's API shape, the app sees the client gone (the request is counted with status
  408) and the connection is closed;
- an idle kept-alive connection is closed after ``keep_alive_s``;
- past ``max_connections`` open connections, a new connection's requests get 503 with
  ``Retry-After`` in the API's shape and it is closed.

Every answer here is a complete JSON error (OpenAI's shape, Anthropic's on ``/v1/messages``)
written straight to the socket: no task, no parsing, no waiting. Refusals are counted in
``smetric_front_door_refusals_total{reason}``; ``smetric_open_connections`` is the gauge.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import orjson
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from stack.config import FrontDoorConfig

log = logging.getLogger("stack.router.front_door")

#: the reasons of ``smetric_front_door_refusals_total``
REASONS = ("header_too_large", "too_many_headers", "header_timeout", "body_timeout", "connections")
#: bytes of a head's start kept to tell which API it speaks (its request line)
_START_BYTES = 64
#: file descriptors the router needs besides its client connections (its calls to workers,
#: health checks, logs, Redis): the open-file limit it asks for is this plus max_connections
_OTHER_FDS = 8192

_MESSAGES = {
    "header_too_large": "request headers over {max_header_bytes} bytes",
    "too_many_headers": "more than {max_headers} request headers",
    "header_timeout": "request headers not received within {header_timeout_s:g} s",
    "body_timeout": "request body not received within {body_timeout_s:g} s",
    "connections": "the router has {max_connections} connections open: retry later",
}
_STATUS = {
    "header_too_large": 431,
    "too_many_headers": 431,
    "header_timeout": 408,
    "body_timeout": 408,
    "connections": 503,
}
#: the OpenAI-shaped error's ``code`` (as the app's own answers of the same kind say it)
_CODES = {
    "header_too_large": "header_too_large",
    "too_many_headers": "too_many_headers",
    "header_timeout": "request_timeout",
    "body_timeout": "request_timeout",
    "connections": "overloaded",
}
_ANTHROPIC_TYPES = {408: "request_timeout_error", 431: "invalid_request_error", 503: "overloaded_error"}


def error_body(reason: str, message: str, anthropic: bool) -> bytes:
    """The JSON body of a refusal for ``reason``, in OpenAI's shape or Anthropic's."""
    status = _STATUS[reason]
    if anthropic:
        err: dict[str, Any] = {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES[status], "message": message},
        }
    else:
        kind = "service_unavailable" if status == 503 else "invalid_request_error"
        err = {"error": {"message": message, "type": kind, "param": None, "code": _CODES[reason]}}
    return orjson.dumps(err)


def raw_answer(status: int, body: bytes, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection."""
    head = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
    ]
    if retry_after_s is not None:
        head.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join(head) + b"\r\n" + body


def _speaks_anthropic(start: bytes) -> bool:
    """Whether a request whose head starts with ``start`` (or whose path is ``start``) is
    Anthropic's (``/v1/messages``)."""
    return b" /v1/messages" in start or start.startswith(b"/v1/messages")


class FrontDoor:
    """The front door of one router: its limits, counters and the protocol class uvicorn
    runs (:meth:`server_config`)."""

    def __init__(
        self, cfg: FrontDoorConfig, registry: CollectorRegistry | None = None, retry_after_s: int = 1
    ):
        self.cfg = cfg
        self.retry_after_s = retry_after_s
        registry = registry if registry is not None else CollectorRegistry()
        #: the server's open connections (uvicorn's set, known from the first connection)
        self.connections: set = set()
        self.refusals = Counter(
            "smetric_front_door_refusals",
            "client connections answered and closed by the front door, by reason",
            ["reason"],
            registry=registry,
        )
        self._by_reason = {r: self.refusals.labels(r) for r in REASONS}
        Gauge("smetric_open_connections", "open client connections", registry=registry).set_function(
            lambda: len(self.connections)
        )
        texts = cfg.model_dump()
        self._messages = {r: m.format(**texts) for r, m in _MESSAGES.items()}

    def refused(self, reason: str) -> None:
        self._by_reason[reason].inc()

    def answer(self, reason: str, anthropic: bool) -> bytes:
        """The whole answer of a refusal for ``reason``."""
        status = _STATUS[reason]
        body = error_body(reason, self._messages[reason], anthropic)
        return raw_answer(status, body, self.retry_after_s if status == 503 else None)

    async def refuse_app(self, scope, receive, send) -> None:
        """The app of a connection over ``max_connections``: 503 and close, for any request."""
        if scope["type"] != "http":
            return
        status = _STATUS["connections"]
        body = error_body(
            "connections", self._messages["connections"], _speaks_anthropic(scope["path"].encode())
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"retry-after", str(self.retry_after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def protocol(self) -> type[HttpToolsProtocol]:
        """uvicorn's httptools protocol, with this door's checks."""
        return type("FrontDoorProtocol", (_DoorProtocol,), {"door": self})

    def server_config(self, app, host: str, port: int, log_level: str = "info", **kw) -> uvicorn.Config:
        """The uvicorn config that serves ``app`` behind this door."""
        return uvicorn.Config(
            app,
            host=host,
            port=port,
            http=self.protocol(),
            timeout_keep_alive=self.cfg.keep_alive_s,  # type: ignore[arg-type]  (seconds, any float)
            log_level=log_level,
            access_log=False,
            **kw,
        )


class _DoorProtocol(HttpToolsProtocol):
    """One client connection behind a :class:`FrontDoor` (``door``: set by
    :meth:`FrontDoor.protocol`)."""

    door: FrontDoor

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head = 0  # bytes of the current request's head so far
        self._lines = 0  # its line ends so far
        self._tail = b""  # the last bytes of the head so far (a line end split across reads)
        self._start = b""  # its first bytes (the request line: which API it speaks)
        self._in_body = False  # between the end of the head and the end of the body
        self._timer: asyncio.TimerHandle | None = None

    # -- connection ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        door = self.door
        door.connections = self.connections
        if len(self.connections) > door.cfg.max_connections:
            self.app = door.refuse_app  # every request on it: 503, then closed
            door.refused("connections")
        self._arm(door.cfg.header_timeout_s, self._head_late)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body and (reason := self._count_head(data)) is not None:
            self._refuse(reason)
            return
        super().data_received(data)

    # -- the head -----------------------------------------------------------------------------
    def _count_head(self, data: bytes) -> str | None:
        """Count the head bytes and lines in ``data`` (up to the head's end); the reason to
        refuse the request, or None."""
        cfg = self.door.cfg
        if self._head == 0 and not self._start:  # a request's first bytes
            self._start = data[:_START_BYTES]
            if self._timer is None:  # a kept-alive connection's next request
                self._arm(cfg.header_timeout_s, self._head_late)
        seen = len(self._tail)
        buf = self._tail + data if seen else data
        end = buf.find(b"\r\n\r\n")
        stop = len(buf) if end < 0 else end + 4
        self._head += stop - seen
        self._lines += buf.count(b"\r\n", max(0, seen - 1), stop)
        self._tail = buf[stop - 3 : stop] if end < 0 else b""
        if self._head > cfg.max_header_bytes:
            return "header_too_large"
        # line ends: the request line's, one per header, and the empty line's once complete
        if self._lines - 1 - (end >= 0) > cfg.max_headers:
            return "too_many_headers"
        return None

    def on_headers_complete(self) -> None:
        self._head = self._lines = 0
        self._tail = self._start = b""
        self._in_body = True
        self._arm(self.door.cfg.body_timeout_s, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    # -- refusals -----------------------------------------------------------------------------
    def _refuse(self, reason: str) -> None:
        """Answer ``reason``'s refusal and close, the rest of the request unread."""
        self._disarm()
        self.door.refused(reason)
        if not self.transport.is_closing():
            self.transport.write(self.door.answer(reason, _speaks_anthropic(self._start)))
            self.transport.close()

    def _head_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._head == 0 and not self._in_body:  # nothing sent: nothing to answer
            self.door.refused("header_timeout")
            self.transport.close()
            return
        self._refuse("header_timeout")

    def _body_late(self) -> None:
        """The body is late: unanswered, the app sees its client gone and the client gets 408;
        answered already, the connection is closed (a stream still being sent is left to end
        and looked at again later)."""
        self._timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if cycle.response_started and not cycle.response_complete:
            self._arm(self.door.cfg.body_timeout_s, self._body_late)
            return
        self.door.refused("body_timeout")
        if not cycle.response_started:
            cycle.scope["smetric.front_door"] = "body_timeout"
            path = cycle.scope.get("path", "")
            self.transport.write(self.door.answer("body_timeout", _speaks_anthropic(path.encode())))
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    # -- timers -------------------------------------------------------------------------------
    def _arm(self, seconds: float, callback) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def raise_open_files(wanted: int) -> int:
    """Raise this process's soft open-file limit to ``wanted`` (at most the hard limit);
    returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit to %d: %s", target, e)
    return soft


def fit_open_files(cfg: FrontDoorConfig) -> None:
    """Raise the open-file limit for ``cfg.max_connections`` clients and the router's own
    calls; warn when the hard limit leaves fewer."""
    want = cfg.max_connections + _OTHER_FDS
    got = raise_open_files(want)
    if got < want:
        log.warning(
            "open-file limit %d is under the %d that router.front_door.max_connections=%d needs: "
            "past it, new connections wait in the listen backlog (raise the hard limit: ulimit -Hn)",
            got,
            want,
            cfg.max_connections,
        )
