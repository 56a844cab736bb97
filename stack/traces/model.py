"""In-memory trace: requests grouped into sessions and agent streams, with prefix paths."""

from __future__ import annotations

from dataclasses import dataclass, field

from stack.kv_tier.prefix_cache import Run


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    ``path``: the prompt's prefix blocks as runs ``(owner, start, end)`` (see intern.py);
    ``n_blocks`` = ``path[-1][2]``. ``prev``: index of the predecessor in the same agent
    stream (-1 for a stream's first turn). ``offset``: seconds from the session's start
    (used for a stream's first turn). ``think``: seconds between the predecessor's answer
    and this request (the agent's / tool's time).
    """

    idx: int
    session: int
    stream: int
    turn: int
    timestamp: float
    offset: float
    think: float
    input_len: int
    output_len: int
    prev: int
    path: tuple[Run, ...] = ()
    n_blocks: int = 0


@dataclass(slots=True)
class Trace:
    name: str
    fmt: str  # "agentic" | "mooncake"
    block_size: int
    requests: list[TraceRequest]
    sessions: list[list[int]]  # request indices per session, in arrival order
    session_start: list[float]  # absolute start time of each session (s)
    has_global_clock: bool
    n_owners: int
    session_labels: list = field(default_factory=list)
    n_shared: int = 0  # owners referenced by more than one session
    # per owner: the block up to which other sessions reference it too (a system prompt, a
    # shared tools prefix; 0 = private). Replayed copies of sessions keep sharing that part
    # and get private keys for the rest.
    shared_upto: list[int] = field(default_factory=list)

    @property
    def duration(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp - self.requests[0].timestamp

    def base_session_rate(self) -> float:
        """Sessions per second in the trace as recorded (span of session starts)."""
        if len(self.session_start) < 2:
            return 1.0
        span = max(self.session_start) - min(self.session_start)
        return (len(self.session_start) - 1) / span if span > 0 else 1.0
