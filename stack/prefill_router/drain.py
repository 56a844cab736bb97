"""A router replica that drains: stops taking work, finishes what it holds, then exits.

A drain starts on SIGTERM (``smetric router``, :class:`DrainingServer`) or on
``POST /admin/drain``. From that moment ``/health`` answers 503 ``draining`` (a load
balancer stops sending), and a new inference request gets its API's overload answer (OpenAI
503, Anthropic 529, with ``Retry-After``) so that its client retries elsewhere. What the
replica holds, queued or in flight, runs to its end. On SIGTERM the process exits once
nothing is in flight and ``router.drain_notice_s`` has passed since the drain began (the
load balancer's probes have seen the 503), or at ``router.drain_timeout_s`` (default: the
request timeout) whatever is left; a second SIGTERM or Ctrl-C exits at once. What follows the
drain (uvicorn's shutdown, then the router's, each of its steps bounded) has ``EXIT_S``: past
it, every thread's stack is written to stderr (the log) and the process exits with status 1, so
a stuck shutdown shows where it stuck and never holds ``smetric down``. A drain started
by the admin API only stops intake (``DELETE /admin/drain`` resumes it): the operator stops
the process.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
import time

import uvicorn

log = logging.getLogger("stack.router")

#: seconds the process may take to exit once drained (or at the drain's timeout)
EXIT_S = 30.0


class Drain:
    """Whether the replica drains, and the inference requests it holds (queued or in flight,
    a streamed answer until its last byte)."""

    def __init__(self) -> None:
        self.draining = False
        self.since: float | None = None  # monotonic seconds the drain began
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> bool:
        """Begin draining (True if it was not already)."""
        if self.draining:
            return False
        self.draining = True
        self.since = time.monotonic()
        log.warning(
            "draining: /health answers 503, new requests get the overload answer; %d in flight", self.inflight
        )
        return True

    def resume(self) -> None:
        """Take new requests again (an admin drain undone)."""
        self.draining = False
        self.since = None

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    async def finished(self, notice_s: float, timeout_s: float) -> bool:
        """Wait until nothing is in flight and ``notice_s`` has passed since the drain began,
        at most ``timeout_s`` from then. True when it drained, False at the timeout."""
        since = self.since if self.since is not None else time.monotonic()
        deadline = since + timeout_s
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        rest = since + notice_s - time.monotonic()
        if rest > 0:
            await asyncio.sleep(min(rest, max(0.0, deadline - time.monotonic())))
        return True

    def describe(self) -> dict:
        return {
            "draining": self.draining,
            "inflight": self.inflight,
            "for_s": round(time.monotonic() - self.since, 3) if self.since is not None else None,
        }


class DrainingServer(uvicorn.Server):
    """uvicorn, where the first SIGTERM drains (:class:`Drain`) before the server stops; a
    second signal, or SIGINT, is uvicorn's own exit."""

    def __init__(self, config: uvicorn.Config, drain: Drain, notice_s: float, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.notice_s = notice_s
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining is not None:  # a second signal while draining: now
            self.force_exit = self.should_exit = True
            return
        if sig != signal.SIGTERM or self._loop is None:
            self.drain.start()
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        if self._draining is None:
            self.drain.start()
            self._draining = asyncio.ensure_future(self._stop_when_drained())

    async def _stop_when_drained(self) -> None:
        done = await self.drain.finished(self.notice_s, self.timeout_s)
        if not done:
            log.warning(
                "drain: %d requests still in flight at drain_timeout_s; stopping", self.drain.inflight
            )
        else:
            log.warning("drained: stopping")
        # a shutdown that hangs: the stacks to the log, and out (exit status 1)
        faulthandler.dump_traceback_later(EXIT_S, exit=True, file=sys.stderr)
        self.should_exit = True
