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

Optional parts make T follow the traffic instead of an operator's setting (all off by
default, so a plain :class:`Readiness` is today's rule):

- ``slo_k`` (alpha) > 0: T is ``slo_k`` times the ``slo_q`` quantile of the TTFT SLOs of the
  last ``slo_window`` admitted requests, recomputed at every admission
  (:class:`AdaptiveReadiness`); ``max_queued_s`` is then only the value before the first
  admission. Chat prompts have SLOs near 1 s and agentic ones of several seconds, so one
  alpha gives each its own threshold (docs/research/dispatch.md, "Readiness from the SLO").
- ``lead_share`` (finite): on an instance whose link backlog is at least ``lead_share``
  times the traffic's SLO scale (the same window quantile), the fetch counts as part of a
  request's lead time, not as a reason to hold it. A request sent there now starts its
  global-tier fetch now and cannot compute before the backlog is through, so only the
  compute queued *beyond* it is waiting the router could have used: the load is
  ``max(0, queued_seconds - fetch_weight * fetch_backlog_s)``. Where the link is the
  bottleneck (a shared NIC) backlogs of that size are common and the queue stops holding
  requests behind them; below the share (per-GPU links) it is today's rule, where holding
  while the link is busy pays (docs/research/dispatch.md, "Readiness from the SLO"). ``inf`` (the
  default): off; 0: always.
- ``lead_queue`` (on): the fetch counts as lead time on an instance whose link backlog is at
  least its own queued prefill seconds, whatever the SLO scale: there the link, not the GPU,
  is what work sent to it waits for, so the load is ``max(0, queued_seconds -
  fetch_weight * fetch_backlog_s)`` as with ``lead_share``. The rule has no constant and
  follows each instance's speeds: on fast GPUs behind the same links (the H200 calibration)
  it counts the fetch as lead time far more often than on slower ones, where short
  backlogs rarely reach the queue (docs/research/dispatch.md, "Choosing the next default:
  the protocol", its revision).
  It replaces ``lead_share`` (the two do not combine).
- ``release_share`` (finite; kept for study, not recommended): an instance whose link
  backlog is at least that share of the SLO scale is ready whatever its queue.

The SLO scale is the window quantile when ``slo_k`` is set, else T itself. The link backlog
is the simulator's link FIFO there; live, the router's own accounting of the fetches it booked
on each worker's link (:meth:`stack.pool.Worker.fetch_booked`, the same FIFO), so the two
shares act in both drivers.

Both drivers build these from the same :class:`~stack.dispatch.spec.DispatchSpec`
(:meth:`Readiness.build`, one object per dispatcher: :class:`AdaptiveReadiness` keeps the
window) and call :meth:`Readiness.observe` at every admission (the dispatcher does).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stack.core.types import InstanceState

#: the keys whose null (YAML) means off, as inf
_OFF_IS_INF = ("max_running", "lead_share", "release_share")


class Readiness(BaseModel):
    """When an instance takes more work from the dispatch queue: the ``readiness`` part of a
    dispatch spec (:class:`~stack.dispatch.spec.DispatchSpec`; the router's
    ``router.dispatch.readiness``, the simulator's ``--dispatch-param``). Each key is defined
    here, once, with its bounds and meaning (the reference is generated from these fields).
    Field defaults are the simulator's; the router's default sets its own
    (:data:`~stack.dispatch.spec.ROUTER_DISPATCH`). ``inf`` (or null in YAML) turns a share off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: T is max_queued_s; adaptive: T = slo_k x the slo_q quantile of the "
        "TTFT SLOs of the last slo_window admitted requests (max_queued_s before the first). "
        "Left out: adaptive when slo_k > 0; mode fixed turns slo_k off",
    )
    max_queued_s: float = Field(
        2.0,
        description="T: an instance is ready while its estimated start (queued prefill "
        "seconds, or its weighted fetch backlog) is below T seconds (label key T)",
    )
    max_running: float = Field(
        math.inf, description="an instance is ready while fewer requests run there (inf or null: no cap)"
    )
    fetch_weight: float = Field(1.0, description="weight of the link's fetch backlog in the estimated start")
    slo_k: float = Field(0.0, description="mode adaptive: T = slo_k x the SLO quantile (0: fixed)")
    slo_q: float = Field(0.5, description="mode adaptive: the quantile of the window's SLOs")
    slo_window: float = Field(256.0, description="mode adaptive: admitted requests in the window")
    lead_share: float = Field(
        math.inf,
        description="the fetch counts as lead time, not a reason to hold, on an instance whose "
        "link backlog is at least this share of the SLO scale (inf or null: off; 0: always)",
    )
    lead_queue: bool = Field(
        False,
        description="the fetch counts as lead time, not a reason to hold, on an instance whose "
        "link backlog is at least its own queued prefill seconds (1: on; replaces lead_share)",
    )
    release_share: float = Field(
        math.inf,
        description="an instance whose link backlog is at least this share of the SLO scale is "
        "ready whatever its queue (inf or null: off; kept for study)",
    )

    @model_validator(mode="before")
    @classmethod
    def _explicit(cls, data: Any) -> Any:
        """null is off (inf); ``mode`` left out follows slo_k; ``mode: fixed`` turns slo_k off."""
        if not isinstance(data, dict):
            return data
        d = {k: (math.inf if v is None and k in _OFF_IS_INF else v) for k, v in data.items()}
        if d.get("mode") == "fixed" and "slo_k" not in data:
            d["slo_k"] = 0.0
        elif "mode" not in d and "slo_k" in d:
            d["mode"] = "adaptive" if float(d["slo_k"]) > 0 else "fixed"
        return d

    @model_validator(mode="after")
    def _valid(self) -> Readiness:
        self.check()
        return self

    def check(self) -> None:
        """Raise ``ValueError`` naming the key on a value out of its range."""
        if not self.max_queued_s > 0:
            raise ValueError("dispatch: max_queued_s must be > 0 (no instance would ever be ready)")
        if not self.max_running >= 1:
            raise ValueError("dispatch: max_running must be >= 1")
        if not self.fetch_weight >= 0:
            raise ValueError("dispatch: fetch_weight must be >= 0")
        if not (self.slo_k >= 0 and math.isfinite(self.slo_k)):
            raise ValueError("dispatch: slo_k must be a finite number >= 0 (0: fixed threshold)")
        if not 0 <= self.slo_q <= 1:
            raise ValueError("dispatch: slo_q must be in [0, 1]")
        if not (self.slo_window >= 1 and self.slo_window == int(self.slo_window)):
            raise ValueError("dispatch: slo_window must be a whole number >= 1")
        if not self.lead_share >= 0:
            raise ValueError("dispatch: lead_share must be >= 0 (inf: off)")
        if not self.release_share >= 0:
            raise ValueError("dispatch: release_share must be >= 0 (inf: off)")
        if self.lead_queue and self.lead_share != math.inf:
            raise ValueError(
                "dispatch: lead_queue replaces lead_share: turn one off (lead_queue: false, the router's "
                "default being on; or lead_share: null)"
            )
        if self.mode == "adaptive" and not self.slo_k > 0:
            raise ValueError("dispatch: readiness mode adaptive needs slo_k > 0")
        if self.mode == "fixed" and self.slo_k != 0:
            raise ValueError("dispatch: slo_k is for readiness mode adaptive (mode fixed: T is max_queued_s)")

    @property
    def adaptive(self) -> bool:
        """Whether this rule needs per-dispatcher state or the lead-time load."""
        return (
            self.slo_k > 0 or self.lead_share != math.inf or self.release_share != math.inf or self.lead_queue
        )

    def build(self) -> Readiness | AdaptiveReadiness:
        """The object one dispatcher uses: this rule itself (it holds no state), or a fresh
        :class:`AdaptiveReadiness` with its own window of SLOs."""
        return AdaptiveReadiness(self) if self.adaptive else self

    @property
    def threshold(self) -> float:
        """T now (fixed here; :class:`AdaptiveReadiness` recomputes it)."""
        return self.max_queued_s

    def observe(self, slo_s: float) -> None:
        """An admitted request's TTFT SLO (used by :class:`AdaptiveReadiness`)."""

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
        return _drained_at(now, instances, self.max_queued_s, self.max_running, self.fetch_weight)


def _drained_at(
    now: float, instances: Sequence[InstanceState], T: float, max_running: float, w: float
) -> float:
    """The first time an instance held back by its fetch backlog alone (``w * backlog >= T``)
    comes under the threshold ``T`` as the backlog drains; ``inf`` if none."""
    t = math.inf
    for s in instances:
        if not s.healthy or s.running >= max_running or s.queued_seconds >= T:
            continue
        if w * s.fetch_backlog_s >= T:
            # w * (backlog - dt) < T  <=>  dt > backlog - T / w (a microsecond past it)
            at = now + s.fetch_backlog_s - T / w + 1e-6
            if at < t:
                t = at
    return t


class AdaptiveReadiness:
    """A :class:`Readiness` with T taken from recent traffic and/or the fetch as lead time
    (see the module docstring), with the same methods the dispatcher calls. One per
    dispatcher (it keeps the window of the last ``slo_window`` admitted SLOs)."""

    __slots__ = (
        "rule",
        "max_queued_s",
        "max_running",
        "fetch_weight",
        "lead_at",
        "lead_queue",
        "release_at",
        "_win",
        "_sorted",
    )

    def __init__(self, rule: Readiness) -> None:
        self.rule = rule
        #: T now: rule.max_queued_s until the first admission when slo_k is set
        self.max_queued_s = rule.max_queued_s
        self.max_running = rule.max_running
        self.fetch_weight = rule.fetch_weight
        #: the backlog (weighted seconds) from which the fetch counts as lead time:
        #: lead_share x the SLO scale (the window quantile; T itself without slo_k)
        self.lead_at = math.inf
        #: the fetch is lead time wherever the backlog reaches the instance's own queue
        self.lead_queue = rule.lead_queue
        #: the backlog from which the instance is ready whatever its queue
        self.release_at = math.inf
        self._win: deque[float] = deque()
        self._sorted: list[float] = []
        self._set(rule.max_queued_s / rule.slo_k if rule.slo_k > 0 else rule.max_queued_s)

    def _set(self, scale: float) -> None:
        r = self.rule
        if r.slo_k > 0:
            self.max_queued_s = r.slo_k * scale
        if r.lead_share < math.inf:
            self.lead_at = r.lead_share * scale
        if r.release_share < math.inf:
            self.release_at = r.release_share * scale

    @property
    def threshold(self) -> float:
        return self.max_queued_s

    def check(self) -> None:
        self.rule.check()

    def observe(self, slo_s: float) -> None:
        """Take an admitted request's SLO into the window and recompute T (and the backlog
        from which the fetch is lead time)."""
        r = self.rule
        if r.slo_k <= 0 or not (slo_s > 0 and math.isfinite(slo_s)):
            return
        win, srt = self._win, self._sorted
        win.append(slo_s)
        bisect.insort(srt, slo_s)
        if len(win) > r.slo_window:
            old = win.popleft()
            del srt[bisect.bisect_left(srt, old)]
        self._set(srt[int(r.slo_q * (len(srt) - 1) + 0.5)])

    def load(self, s: InstanceState) -> float:
        """Seconds of queued work that work sent to ``s`` now would wait for beyond its own
        lead where the link's backlog reaches :attr:`lead_at`, else the estimated start as
        :meth:`Readiness.load`."""
        f = self.fetch_weight * s.fetch_backlog_s
        q = s.queued_seconds
        if f >= self.release_at:
            return 0.0
        if f >= self.lead_at or (self.lead_queue and f >= q):
            return q - f if q > f else 0.0
        return f if f > q else q

    def is_ready(self, s: InstanceState) -> bool:
        return s.healthy and s.running < self.max_running and self.load(s) < self.max_queued_s

    def mask(self, instances: Sequence[InstanceState]) -> list[bool]:
        return self.scan(instances)[1]

    def scan(self, instances: Sequence[InstanceState]) -> tuple[float | None, list[bool]]:
        """As :meth:`Readiness.scan`; the estimated start it returns stays the instance's
        (``max(queued, fetch)``: what the orders' feasibility needs), readiness uses
        :meth:`load`."""
        best = None
        mask = []
        T = self.max_queued_s
        R = self.max_running
        w = self.fetch_weight
        lead = self.lead_at
        lq = self.lead_queue
        rel = self.release_at
        for s in instances:
            f = w * s.fetch_backlog_s
            q = s.queued_seconds
            x = f if f > q else q
            ok = (
                s.healthy
                and s.running < R
                and (f >= rel or ((q - f) if (f >= lead or (lq and f >= q)) else x) < T)
            )
            mask.append(ok)
            if ok and (best is None or x < best):
                best = x
        return best, mask

    def next_change(self, now: float, instances: Sequence[InstanceState]) -> float:
        """As :meth:`Readiness.next_change` (where the fetch counts as lead time, a draining
        backlog makes an instance less ready, never more: the same timer covers it)."""
        return _drained_at(now, instances, self.max_queued_s, self.max_running, self.fetch_weight)
