"""Session slowdown: how much longer a session took than it would have alone on the cluster.

A session's completion time is from its start to the answer of its last turn. *Alone*, each
of its turns would be prefilled on an idle instance holding the session's own earlier
turns (its predecessor's prompt cached, nothing from other sessions), with no queue, no
fetch, no retry; the agent's think time and the decode stay what they were. So a stream's
time alone is its time in the run less each turn's delay (its TTFT, from its client's
first attempt, minus its TTFT alone), and the session's time alone is its latest stream's.
Slowdown = completion time / completion time alone (1 = as fast as alone).

Counted: sessions that started inside the measurement window and ran to their last turn
(a session cut off by the run's end is left out). A session with a turn that failed (an
overload answer or a timeout after the client's retries) never completes: it is counted in
``sessions_failed``, not in the quantiles, so the two are read together (shedding a turn
fails its session). Computed by :class:`SessionClock`, pure bookkeeping the engine feeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stack.core.cost_model import CostModel
from stack.kv_tier.prefix_cache import Run
from stack.stats import percentile
from stack.traces.model import Trace, TraceRequest


def common_blocks(a: tuple[Run, ...], b: tuple[Run, ...]) -> int:
    """Blocks two prefix paths share from their start."""
    n = 0
    for (oa, sa, ea), (ob, sb, eb) in zip(a, b):
        if oa != ob or sa != sb:
            break
        n = min(ea, eb)
        if ea != eb:
            break
    return n


def ttft_alone(
    trace: Trace, tr: TraceRequest, cost: CostModel, handoff_s: Callable[[float], float] | None = None
) -> float:
    """``tr``'s TTFT alone: its prompt less what its predecessor in the stream left cached,
    and the PD hand-off (``handoff_s``, if charged)."""
    L = tr.input_len
    cached = 0
    if tr.prev >= 0:
        cached = common_blocks(tr.path, trace.requests[tr.prev].path) * trace.block_size
        cached = min(cached, L - 1)
    return cost.cost(L - cached, L) + (handoff_s(L) if handoff_s is not None else 0.0)


@dataclass(slots=True)
class _Session:
    start: float
    left: int  # turns not yet answered
    streams: dict[int, list[float]] = field(default_factory=dict)  # stream: [end, delay]


class SessionClock:
    """Per session of the measurement window: its turns' delays and answers; the slowdowns
    of those that finished."""

    def __init__(
        self,
        trace: Trace,
        cost: CostModel,
        w_start: float,
        w_end: float,
        handoff_s: Callable[[float], float] | None = None,
    ) -> None:
        self.trace = trace
        self.cost = cost
        self.handoff_s = handoff_s
        self.w_start, self.w_end = w_start, w_end
        self.open: dict[int, _Session] = {}  # by the copy's id (SessionStart.copy)
        self.slowdowns: list[float] = []
        self.failed = 0

    def _session(self, copy: int, start: float, session: int) -> _Session | None:
        s = self.open.get(copy)
        if s is None:
            if not self.w_start <= start <= self.w_end:
                return None
            s = _Session(start, len(self.trace.sessions[session]))
            self.open[copy] = s
        return s

    def first_token(self, copy: int, start: float, tr: TraceRequest, ttft: float) -> None:
        """A turn of the session's copy ``copy`` (started at ``start``) had its first token
        ``ttft`` seconds after its client's first attempt."""
        s = self._session(copy, start, tr.session)
        if s is None:
            return
        st = s.streams.get(tr.stream)
        if st is None:
            st = s.streams[tr.stream] = [start, 0.0]
        st[1] += ttft - ttft_alone(self.trace, tr, self.cost, self.handoff_s)

    def answered(self, copy: int, tr: TraceRequest, at: float) -> None:
        """The turn's answer completed at ``at``; the session's last one closes it."""
        s = self.open.get(copy)
        if s is None:
            return
        st = s.streams.get(tr.stream)
        if st is None:
            return
        st[0] = at
        s.left -= 1
        if s.left == 0:
            del self.open[copy]
            took = max(end for end, _ in s.streams.values()) - s.start
            alone = max(end - s.start - delay for end, delay in s.streams.values())
            self.slowdowns.append(took / alone if alone > 0 else 1.0)

    def failed_turn(self, copy: int, start: float, session: int) -> None:
        """A turn of the session failed for good: the session never completes."""
        s = self._session(copy, start, session)
        if s is None:
            return
        del self.open[copy]
        self.failed += 1

    def metrics(self) -> dict:
        sd = sorted(self.slowdowns)
        return {
            "sessions_complete": len(sd),
            "sessions_failed": self.failed,
            "session_slowdown_p50": percentile(sd, 0.5),
            "session_slowdown_p90": percentile(sd, 0.9),
        }
