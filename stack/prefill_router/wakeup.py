"""When a pump runs: :class:`Wakeup` calls one function soon (requests coalesced into one
call) or at a time (one timer, moved only earlier until it fires or is disarmed), on the
running event loop. The dispatch queue's pump runs this way (:mod:`stack.prefill_router.queue`)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class Wakeup:
    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.scheduled = False  # a call is pending on the loop
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def soon(self) -> None:
        """Call ``run`` soon, once however often asked before it runs (no loop: a no-op)."""
        if self.scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.scheduled = True
        loop.call_soon(self._fire)

    def at(self, now: float, at: float) -> None:
        """Call ``run`` at ``at`` (``now``: the caller's clock), unless it is armed earlier."""
        if at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._on_timer)

    def disarm(self) -> None:
        """Cancel the timer (a pending :meth:`soon` still runs)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def _fire(self) -> None:
        self.scheduled = False
        self.run()

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self.run()
