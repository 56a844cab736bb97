"""The counts a simulated run keeps as it goes: one typed record, read at the end by
stack/sim/metrics.py to build the figures ``smetric sim`` writes.

Two kinds of count live here. The *conservation* counts cover every attempt, measured or
not: each one issued is served once, rejected by the router's queue, or taken back when its
client gave up (:meth:`Tally.conserved` checks it at the end). The *measured* counts
cover only the requests whose first attempt came in within the measurement window: what was
served and how fast, what the KV tiers gave, how the policy decided, and how the clients
fared (client model only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stack.core.types import DecisionKind
from stack.sim.instance import Job


@dataclass(slots=True)
class Tally:
    """Every count of one run (module docstring)."""

    # conservation: every attempt, measured or not
    issued: int = 0  # attempts that arrived (retries included)
    served: int = 0  # prefills completed
    rejected: int = 0  # overload answers from the router's queue
    cancelled: int = 0  # attempts the router took back when their client gave up
    # the router's queue, every attempt
    rejected_wait_max: float = 0.0  # the longest a rejected attempt had waited
    queue_depth_max: int = 0  # the most requests queued over all replicas at once
    bypassed: int = 0  # dispatched at arrival past the queue (stack/dispatch/bypass.py)
    unbound: int = 0  # released to every instance rather than the ready ones
    # measured requests served: TTFT against the SLO
    requests: int = 0
    met: int = 0
    prompt: int = 0  # prompt tokens
    prompt_met: int = 0  # prompt tokens of the requests that met their SLO
    over_2x: int = 0
    over_5x: int = 0
    # measured requests served: where their prompt's KV came from
    local: int = 0
    glob: int = 0
    computed: int = 0
    fetch_tokens: int = 0
    fetch_wait_s: float = 0.0
    fetch_requests: int = 0
    rematch_short: int = 0  # matched less at schedule than the router saw at arrival
    rematch_short_tokens: int = 0
    # measured requests served: the policy's decision
    sticks: int = 0
    migrations: int = 0
    first_turns: int = 0
    evicted_followups: int = 0
    balanced: int = 0
    # measured requests that were not served, and the client model's figures
    rejected_measured: int = 0  # rejected, and not retried (or out of retries)
    failed: int = 0  # timed out on the last attempt
    attempts: int = 0
    refusals: int = 0  # rejections met (their client may retry)
    timeouts: int = 0
    abandoned_served: int = 0  # computed for a client that had already given up
    # per measured request served, in order of completion
    ttfts: list[float] = field(default_factory=list)
    qwaits: list[float] = field(default_factory=list)

    def count_served(self, j: Job, ttft: float, slo: float) -> None:
        """Measured ``j`` got its first token ``ttft`` seconds after it first arrived, against
        a TTFT SLO of ``slo`` seconds."""
        L = j.L
        self.requests += 1
        self.prompt += L
        self.local += j.local
        self.glob += j.glob
        self.computed += L - j.local - j.glob
        if j.fetched:
            self.fetch_tokens += j.fetched
            self.fetch_wait_s += j.fwait
            self.fetch_requests += 1
        if ttft <= slo:
            self.met += 1
            self.prompt_met += L
        elif ttft > 2.0 * slo:
            self.over_2x += 1
            if ttft > 5.0 * slo:
                self.over_5x += 1
        k = j.kind
        if k is DecisionKind.STICK:
            self.sticks += 1
        elif k is DecisionKind.MIGRATE:
            self.migrations += 1
        elif k is DecisionKind.FIRST_TURN:
            # a follow-up balanced as if new (SMetric: its session was evicted locally)
            if j.req.turn > 1:
                self.evicted_followups += 1
            else:
                self.first_turns += 1
        else:
            self.balanced += 1
        self.ttfts.append(ttft)
        self.qwaits.append(j.qwait)

    def conserved(self, queued: int) -> bool:
        """Whether every attempt is accounted for, ``queued`` still being in the router's queue."""
        return not queued and self.issued == self.served + self.rejected + self.cancelled
