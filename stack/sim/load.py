"""Load generation that respects causality (docs/definitions.md, "Load model").

A *plan* says when each session starts and which trace session it replays. Inside a
session, an agent stream's first turn arrives at ``start + offset``; every later turn
arrives ``think`` seconds after its predecessor has been answered (closed loop), so a
follow-up never arrives before its predecessor's answer.

Two modes:

- ``sessions`` (stationary): session starts are a seeded Poisson process at
  ``session_rate`` per second over ``[0, duration)``; each start replays a whole trace
  session, drawn without replacement and reshuffled when the trace is exhausted (sessions
  repeated as needed). Copies get distinct KV keys.
- ``compress`` (for traces with a real global clock, e.g. Mooncake): every trace session
  once, with its recorded start divided by ``rate_scale``; follow-ups still wait for their
  predecessor's answer (arrival = max(compressed timestamp, answer + 0)). Every request is
  simulated; metrics count the requests that arrive within the compressed span (after the
  warm-up), so a follow-up pushed past the span by slow service is not credited.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from stack.traces.model import Trace

#: a perturbation's bounds (LoadSpec.perturb): session starts move by up to 1 ms, think times
#: by up to 1% of themselves
ARRIVAL_JITTER_S = 0.001
THINK_JITTER = 0.01


@dataclass(frozen=True, slots=True)
class LoadSpec:
    mode: str = "sessions"  # sessions | compress
    session_rate: float | None = None  # sessions/s (sessions mode); None -> rate_scale x base
    rate_scale: float = 1.0
    duration: float = 28800.0  # seconds of session arrivals (sessions mode only)
    warmup: float | None = None  # metrics exclude arrivals before this; None: 5/8 of the run
    # (sessions mode) or a tenth of the compressed span (compress mode)
    seed: int = 0
    max_think: float | None = None  # cap on think times (s); None = as recorded
    measure_until: float | None = None  # compress mode: end of the measurement window
    # (default: the compressed span of the trace; math.inf: every request)
    #: a perturbation of the same workload (the chaos floor, docs/research/fidelity.md): None, or the
    #: seed of one: every session start moves by up to +-ARRIVAL_JITTER_S and every think time
    #: by up to +-THINK_JITTER of itself, uniformly; the sessions and their order stay
    perturb: int | None = None

    def think(self, raw: float, copy: int, idx: int) -> float:
        """The think time before request ``idx`` of session copy ``copy``: the recorded
        ``raw``, capped at ``max_think``, perturbed when ``perturb`` is set (deterministic
        per request, so the simulator and a replay agree)."""
        t = raw if self.max_think is None or raw <= self.max_think else self.max_think
        if self.perturb is None:
            return t
        u = random.Random(hash((self.perturb, copy, idx))).uniform(-1.0, 1.0)
        return t * (1.0 + THINK_JITTER * u)

    def validate(self) -> None:
        if self.mode not in ("sessions", "compress"):
            raise ValueError(f"unknown load mode {self.mode!r} (sessions, compress)")
        if self.rate_scale <= 0:
            raise ValueError("rate scale must be > 0")
        if self.session_rate is not None and self.session_rate <= 0:
            raise ValueError("session rate must be > 0")
        if self.duration <= 0:
            raise ValueError("duration must be > 0")
        if self.warmup is not None and (
            self.warmup < 0 or (self.mode == "sessions" and self.warmup >= self.duration)
        ):
            raise ValueError("warmup must be >= 0 and shorter than the duration")
        if self.max_think is not None and self.max_think < 0:
            raise ValueError("max think time must be >= 0")


@dataclass(slots=True)
class SessionStart:
    copy: int  # distinct id of this replayed copy (its session id for routing)
    session: int  # trace session index
    start: float  # absolute start (s)
    time_scale: float = 1.0  # offsets are divided by this (compress mode)
    replica: int = 0  # how many times this trace session was drawn before: KV keys of
    # replica r are offset by r, so a repeated session never hits its earlier copy's KV,
    # while prefixes shared across sessions (system prompts) stay shared within a replica


LOAD_MODES = ("auto", "sessions", "compress")


def resolve_load_mode(trace: Trace, mode: str = "auto") -> str:
    """The load mode a run uses: ``auto`` means compress for a trace with a real global clock
    (Mooncake: its timestamps are the load) and sessions otherwise (agentic traces only
    record each session's own clock, so their starts must be drawn). The one place this
    rule lives, so the simulator, the bench, demo and replay never disagree."""
    if mode == "auto":
        return "compress" if trace.has_global_clock else "sessions"
    return mode


def rate_of(spec: LoadSpec, trace: Trace) -> float:
    if spec.session_rate is not None:
        return spec.session_rate
    return spec.rate_scale * trace.base_session_rate()


def _jitter(starts: list[SessionStart], perturb: int | None) -> None:
    """With ``perturb``, the same starts, each moved by at most :data:`ARRIVAL_JITTER_S` (in
    compress mode the session's recorded arrivals move with its start)."""
    if perturb is None:
        return
    jr = random.Random(perturb)
    for st in starts:
        st.start = max(0.0, st.start + jr.uniform(-ARRIVAL_JITTER_S, ARRIVAL_JITTER_S))


def plan(trace: Trace, spec: LoadSpec) -> tuple[list[SessionStart], float, float]:
    """Session starts, and the measurement window (start, end) in simulated seconds."""
    spec.validate()
    if spec.mode == "compress":
        t0 = min(trace.session_start)
        scale = spec.rate_scale
        starts = [
            SessionStart(copy=s, session=s, start=(st - t0) / scale, time_scale=scale)
            for s, st in enumerate(trace.session_start)
        ]
        end = max(r.timestamp for r in trace.requests) - t0
        end = end / scale if end > 0 else 1.0
        warm = 0.1 * end if spec.warmup is None else min(spec.warmup, 0.9 * end)
        if spec.measure_until is not None:
            end = spec.measure_until
        _jitter(starts, spec.perturb)
        return starts, warm, end
    rng = random.Random(spec.seed)
    rate = rate_of(spec, trace)
    order: list[int] = []
    out: list[SessionStart] = []
    t = rng.expovariate(rate)
    copy = 0
    rounds = -1
    while t < spec.duration:
        if not order:
            order = list(range(len(trace.sessions)))
            rng.shuffle(order)
            rounds += 1
        out.append(SessionStart(copy=copy, session=order.pop(), start=t, replica=rounds))
        copy += 1
        t += rng.expovariate(rate)
    _jitter(out, spec.perturb)
    # agentic sessions run for hours: the offered load is within ~10% of its long-run level
    # after ~5 h of Poisson session starts (measured on the agentic trace)
    warm = spec.duration * 0.625 if spec.warmup is None else spec.warmup
    return out, warm, spec.duration
