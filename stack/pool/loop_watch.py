"""The router's own stalls: a call or a health check that failed while the router's event loop
stood still failed on the router's side (its timeout ran while nothing ran, its pooled
connections went stale meanwhile), so it does not count against the worker.

:class:`LoopWatch` ticks every ``tick_s`` and notes a stall when a tick comes more than
``stall_s`` late; :meth:`LoopWatch.stalled_since` tells whether one happened since a call
began, or is happening now (the tick itself is overdue).
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("stack.router.workers")


class LoopWatch:
    """Notices event-loop stalls longer than ``stall_s`` (module docstring)."""

    def __init__(self, tick_s: float = 0.05, stall_s: float = 0.5) -> None:
        self.tick_s = tick_s
        self.stall_s = stall_s
        self.last_tick = time.monotonic()
        #: when the last stall was noticed (its end), monotonic seconds; -inf: never
        self.last_stall = float("-inf")
        #: stalls noticed
        self.stalls = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.last_tick = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """One tick at ``now``: a stall when it came more than ``stall_s`` late."""
        late = now - self.last_tick - self.tick_s
        self.last_tick = now
        if late > self.stall_s:
            self.last_stall = now
            self.stalls += 1
            log.warning(
                "the router's event loop stood still %.2f s: worker failures in it are not counted", late
            )

    def stalled_since(self, t0: float) -> bool:
        """Whether the loop stalled since ``t0`` (monotonic seconds), or stands still now."""
        now = time.monotonic()
        return self.last_stall >= t0 or now - self.last_tick > self.tick_s + self.stall_s
