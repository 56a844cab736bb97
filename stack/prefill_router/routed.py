"""A routed request through its life: what the router records once it is sent, when its prefill
answer returns, at its first token, when it fails, and when it ends.

:meth:`~stack.prefill_router.routing.PrefillRouter.route` returns one :class:`Routed`, already
booked on its workers (a :class:`~stack.pool.booking.Booking`). Its hooks, in the order a
request meets them (in the style of llm-d's PreRequest / ResponseComplete plugin hooks):

- :meth:`Routed.pre_request`: about to be sent; the routing history of its prefix (for
  workers that publish no KV events) and its session hint's agreement;
- :meth:`Routed.prefill_done`: the prefill answer returned; the prefill worker's queued work
  ends, and a worker with no KV events is taken to have written the prompt's blocks through
  to the global tier;
- :meth:`Routed.first_token`: the first streamed chunk (its TTFT), handed to a learning policy;
- :meth:`Routed.failed`: a worker failed before anything was streamed; the booking is
  released and, when it may be retried, the failure counts against the failing worker
  (ejected after ``router.health_failures`` in a row) and it is left out
  (:class:`Excluded`) of the next try;
- :meth:`Routed.release`: the answer ended (or failed); the booking is released, once.

No web framework here: the HTTP layer calls the hooks and shapes the answers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from stack.core.types import DecisionKind
from stack.core.types import Request as PRequest
from stack.kv_tier.index import PrefixIndex
from stack.policies import Policy
from stack.pool import Booking, Worker, WorkerRegistry
from stack.prefill_router.session_hints import HintTracker

if TYPE_CHECKING:
    from stack.decode_router.upstream import UpstreamError

log = logging.getLogger("stack.router")


class Records(Protocol):
    """Where a routed request records its lifecycle: the router's hint tracker, prefix index,
    global tier, policy and pool (:class:`~stack.prefill_router.routing.PrefillRouter` is one)."""

    hints: HintTracker
    index: PrefixIndex
    global_tier: Any
    policy: Policy
    registry: WorkerRegistry


@dataclass(slots=True)
class Excluded:
    """The workers one request leaves out when it is routed again after a failure."""

    prefill: set[int] = field(default_factory=set)
    decode: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Routed:
    """A routed and already booked request, with the hooks of its lifecycle (module docstring)."""

    booking: Booking
    kind: DecisionKind
    local_hit: int  # tokens cached on the chosen prefill worker
    global_hit: int  # tokens in the global tier
    request: PRequest  # what the policy was asked about (handed back to observe)
    feedback: Sequence[float] | None  # the policy's own feedback inputs (Policy.feedback)
    hashes: list[int] = field(default_factory=list)  # the prompt's block hashes
    router: Records | None = None  # whose index, global tier, policy and pool it records in

    @property
    def prefill(self) -> Worker:
        return self.booking.prefill

    @property
    def decode(self) -> Worker | None:
        return self.booking.decode

    def pre_request(self, session_id: str | None = None) -> str | None:
        """The request is about to be sent: record its prefix as routed to its prefill worker
        (routing history, for workers that publish no KV events). ``session_id``: a hinted
        request's session on its first try; returns the hint's outcome (``agree``,
        ``disagree``, ``first``: :class:`~stack.prefill_router.session_hints.HintTracker`),
        else None."""
        rt = self.router
        outcome = None
        if session_id is not None:
            outcome = rt.hints.observe(session_id, self.prefill.wid)
        if self.hashes:
            rt.index.record_routed(self.prefill.wid, self.hashes)
        return outcome

    def prefill_done(self) -> None:
        """The prefill answer returned: its queued work leaves the worker's load; a worker that
        publishes no KV events is taken to have written the prompt's blocks to the global tier."""
        self.router.registry.call_ok(self.prefill)
        if self.booking.prefill_done() and self.hashes and not self.prefill.kv_events:
            self.router.global_tier.record_written(self.hashes)

    def first_token(self, ttft_s: float) -> None:
        """The answer's first chunk arrived ``ttft_s`` after the request: a learning policy
        sees it (and never breaks serving)."""
        try:
            if self.feedback is not None:
                self.router.policy.observe(self.request, self.prefill.wid, self.feedback, ttft_s)
        except Exception:
            log.exception("policy.observe")

    def failed(self, e: UpstreamError, excluded: Excluded, health_failures: int, counts: bool = True) -> bool:
        """A worker failed before anything was streamed. The booking is released; when the
        failure may be retried (True), it counts against the failing worker (``counts``: False
        when the router itself stalled meanwhile; ejected after ``health_failures`` in a row,
        :meth:`~stack.pool.registry.WorkerRegistry.call_failed`), and the worker and this
        prefill worker are added to ``excluded``. A failed hand-off (``e.pair``: the decode
        half gave up waiting for its prefill twin) counts against the prefill worker, not the
        decode worker, and only the prefill worker is left out."""
        self.booking.release()
        if not e.retryable:
            return False
        excluded.prefill.add(self.prefill.wid)
        # a failed hand-off (decode gave up waiting for its prefill twin) counts against the
        # prefill worker the decode worker waited for, and leaves only it out
        culprit = self.prefill if e.pair else e.worker
        if counts:
            self.router.registry.call_failed(culprit, health_failures)
        (excluded.prefill if culprit.role == "prefill" else excluded.decode).add(culprit.wid)
        return True

    def release(self) -> None:
        """The answer ended (or failed, or the client left): the booking is released, once."""
        self.booking.release()
