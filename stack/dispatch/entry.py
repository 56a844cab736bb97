"""What the dispatcher holds: one admitted request, and the two outcomes it can have.

Plain data, no I/O: the simulator and the live router build the same :class:`Entry` for a
request and get the same :class:`Rejected` back when a bound refuses it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from stack.core.cost_model import CostModel
from stack.core.types import Request


class State(int, Enum):
    QUEUED = 0
    RELEASED = 1
    REJECTED = 2
    CANCELLED = 3  # its client left while it waited


@dataclass(slots=True, eq=False)
class Entry:
    """One request waiting for dispatch.

    ``slo_s``: its TTFT budget (``SLO.ttft(L)``), so ``deadline = arrival + slo_s``.
    ``size_s``: the driver's estimate of its prefill seconds (:func:`estimate_size`), used
    to decide whether it can still meet its deadline and by size-aware orders.
    ``handle``: the driver's own object (the simulator's trace item, the HTTP router's
    pending response), never read here. ``seq`` is set on admission (arrival order; ties
    in every order are broken by it, so release order is deterministic).
    ``deferrals`` counts how often an order put the entry behind others because it could no
    longer meet its deadline; ``aged`` is set when a bounded deferral ran out; ``lost`` when
    it passed an order's far deadline (``far_k``).
    ``key``: the prompt's fingerprint (its length and last block hash; None: too short to
    have one), by which the dispatcher knows the retry of a request it refused;
    ``readmitted`` is set on such a retry (:class:`~stack.dispatch.dispatcher.Dispatcher`).
    """

    handle: Any
    request: Request
    arrival: float
    slo_s: float
    size_s: float
    seq: int = -1
    state: State = State.QUEUED
    deferrals: int = 0
    aged: bool = False
    lost: bool = False
    key: Hashable | None = None
    readmitted: bool = False

    @property
    def deadline(self) -> float:
        return self.arrival + self.slo_s

    def waited(self, now: float) -> float:
        return now - self.arrival


@dataclass(frozen=True, slots=True)
class Rejected:
    """A request the dispatcher refuses: ``reason`` is ``queue_full`` (the queue bound was
    reached at admission) or ``max_queue_wait`` (it waited longer than the bound). The
    driver must answer it explicitly (HTTP: 503 with Retry-After, Anthropic paths 529);
    it is never dropped silently."""

    entry: Entry
    reason: str
    waited_s: float


QUEUE_FULL = "queue_full"
MAX_QUEUE_WAIT = "max_queue_wait"


def estimate_size(cost: CostModel, req: Request) -> float:
    """Estimated prefill seconds of ``req`` when its history (``est_hit``) is reused from
    some tier: ``cost(L - est_hit, L)``. The router cannot know, before choosing, which
    instance will serve it; with a global tier the history is reusable everywhere, so this
    is the figure deadline feasibility should use (a first turn is its full cold cost)."""
    L = req.prompt_tokens
    new = L - min(req.est_hit, L)
    if new < 1 and L > 0:
        new = 1  # the last prompt token is always computed
    return cost.cost(new, L)
