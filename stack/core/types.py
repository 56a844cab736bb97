"""The request and cluster model shared by the live router and the simulator.

Everything here is plain data: no I/O, no web framework, no clients. A driver (the
simulator or the HTTP router) fills a :class:`ClusterView` for each request and asks a
policy to ``choose`` an instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class DecisionKind(str, Enum):
    """Why a policy chose an instance (counted as sticks / migrations / first turns)."""

    FIRST_TURN = "first_turn"  # turn 1 (or an evicted session treated as one): balanced
    STICK = "stick"  # follow-up kept on the instance holding its session
    MIGRATE = "migrate"  # follow-up moved off the instance holding its session
    BALANCE = "balance"  # a policy that does not reason about sessions


@dataclass(frozen=True, slots=True)
class SLO:
    """TTFT SLO linear in the prompt length: ``b + a * L`` seconds (a per token), and a fixed
    TPOT SLO (seconds per output token after the first; the paper's 20 ms for the 30B model,
    §5.2), which only PD colocation scores (under disaggregation decode is another pool's)."""

    b: float = 1.0
    a: float = 62.5e-6  # 62.5 ms per 1k tokens
    tpot: float = 0.020

    def ttft(self, prompt_tokens: int) -> float:
        return self.b + self.a * prompt_tokens

    def validate(self) -> SLO:
        """``self``, or ``ValueError`` naming the flags that set a bad term."""
        if self.b < 0 or self.a < 0:
            raise ValueError("--slo-b and --slo-a must be >= 0")
        if not self.tpot > 0:
            raise ValueError("--slo-tpot must be > 0")
        return self


def usable_hit(hit_tokens: int, prompt_tokens: int) -> int:
    """Cached prefix tokens a prefill can skip: at most ``prompt_tokens - 1``, since the last
    prompt token is always computed (it yields the first output token). Both drivers' view
    builders apply this rule to local and global hits."""
    cap = prompt_tokens - 1 if prompt_tokens > 0 else 0
    return hit_tokens if hit_tokens < cap else cap


@dataclass(slots=True)
class Request:
    """What the router knows about one request, derived from the request itself.

    ``est_hit`` is the history without the newly appended turn (tokens an instance that
    served the previous turn should still hold). ``session_id`` is only used by policies
    that need an explicit session id (llm-d session affinity).
    """

    prompt_tokens: int
    turn: int = 1
    est_hit: int = 0
    session_id: str | None = None
    output_tokens: int = 0


@dataclass(slots=True)
class InstanceState:
    """One prefill instance as the router sees it when routing one request.

    ``queued_tokens`` / ``queued_seconds``: prefill work still to do on the instance
    (waiting plus the unfinished part of running requests), in new tokens and in
    estimated seconds. ``running``: requests queued or running (the l_i of the paper; under
    PD colocation the decoding ones too: requests from dispatch to finish).
    ``local_hit``: tokens of *this* request's prefix cached on the instance.
    ``fetch_backlog_s``: seconds of global-tier transfers already queued on the instance's
    link (a link may be shared by the GPUs of a server); 0 when unknown.
    ``active_tokens``: whole prompt tokens (cached part included) of the requests counted in
    ``running``: the instance's KV footprint as production cache-aware schedulers weigh it.
    ``decode_running`` / ``decode_tokens``: requests decoding on the instance and the sum
    of their contexts (prompt plus tokens generated so far), and ``decode_step_s`` the
    seconds those decodes add to each forward the instance runs (their attention and their
    tokens' linear cost): PD colocation's decode load. Under PD disaggregation a prefill
    instance runs no decode, so both drivers leave them 0 by construction; the simulator's
    colocated mode fills them.
    """

    index: int
    queued_tokens: int = 0
    queued_seconds: float = 0.0
    running: int = 0
    local_hit: int = 0
    decode_tokens: int = 0
    fetch_backlog_s: float = 0.0
    healthy: bool = True
    active_tokens: int = 0
    decode_running: int = 0
    decode_step_s: float = 0.0


@dataclass(slots=True)
class ClusterView:
    """The cluster as seen when routing one request.

    ``global_hit``: tokens of the request's prefix in the global (Mooncake) tier.
    ``fetch_tokens_per_s``: expected per-instance fetch bandwidth from the global tier, in
    tokens per second (0 when there is no global tier).
    """

    now: float
    instances: list[InstanceState]
    global_hit: int = 0
    fetch_tokens_per_s: float = 0.0
    block_size: int = 64


@dataclass(frozen=True, slots=True)
class Decision:
    instance: int
    kind: DecisionKind = DecisionKind.BALANCE
