"""When an instance may take another request from the dispatch queue.

Late binding holds requests at the router until an instance is *ready*, so the choice of
instance is made with the freshest view and the queue's order decides who goes next. An
instance is ready when its queued prefill work is below ``max_queued_s`` seconds (T) and it
runs fewer than ``max_running`` requests. The link's fetch backlog counts: a request sent
now cannot start before its global-tier fetch, queued behind ``fetch_backlog_s`` of
transfers, so the instance's load is ``max(queued_seconds, fetch_weight * fetch_backlog_s)``
(computation overlaps transfers, hence the max rather than the sum).

Why T should not be small: a request held at the router has not started its fetch, so
with T well below a fetch's duration the GPU idles while the fetch of the next request
runs (a simulated run with T = 0.5 s lost 25%). T of a couple of seconds keeps a short queue on each instance to hide the fetches.
T has no default here: each driver's lives in :mod:`stack.dispatch.spec` (the router's
4 s, the simulator's 2 s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stack.core.types import InstanceState


@dataclass(frozen=True, slots=True)
class Readiness:
    max_queued_s: float
    max_running: float = math.inf
    fetch_weight: float = 1.0

    def validate(self) -> None:
        if not self.max_queued_s > 0:
            raise ValueError("dispatch: max_queued_s must be > 0 (no instance would ever be ready)")
        if not self.max_running >= 1:
            raise ValueError("dispatch: max_running must be >= 1")
        if self.fetch_weight < 0:
            raise ValueError("dispatch: fetch_weight must be >= 0")

    def load(self, s: InstanceState) -> float:
        """Seconds before work sent to ``s`` now could start (the estimated start)."""
        f = self.fetch_weight * s.fetch_backlog_s
        return f if f > s.queued_seconds else s.queued_seconds

    def is_ready(self, s: InstanceState) -> bool:
        return s.healthy and s.running < self.max_running and self.load(s) < self.max_queued_s

    def mask(self, instances: Sequence[InstanceState]) -> list[bool]:
        return self.scan(instances)[1]

    def scan(self, instances: Sequence[InstanceState]) -> tuple[float | None, list[bool]]:
        """(the smallest estimated start over the ready instances, or None when none is
        ready; which instances are ready), in one pass: :meth:`load` and :meth:`is_ready`
        inlined, since this runs at every release."""
        best = None
        mask = []
        T = self.max_queued_s
        R = self.max_running
        w = self.fetch_weight
        for s in instances:
            f = w * s.fetch_backlog_s
            x = f if f > s.queued_seconds else s.queued_seconds
            ok = s.healthy and s.running < R and x < T
            mask.append(ok)
            if ok and (best is None or x < best):
                best = x
        return best, mask

    def next_change(self, now: float, instances: Sequence[InstanceState]) -> float:
        """When, without any other event, an instance that is not ready becomes ready: only
        a fetch backlog drains by itself with time (queued seconds and running requests
        change on completions, which the driver reports as events). ``inf`` if never."""
        t = math.inf
        w = self.fetch_weight
        T = self.max_queued_s
        for s in instances:
            if not s.healthy or s.running >= self.max_running or s.queued_seconds >= T:
                continue
            f = w * s.fetch_backlog_s
            if f >= T:
                # w * (backlog - dt) < T  <=>  dt > backlog - T / w (a microsecond past it)
                at = now + s.fetch_backlog_s - T / w + 1e-6
                if at < t:
                    t = at
        return t
