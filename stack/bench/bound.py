"""A clairvoyant upper bound on prefill TPS, and a first guess of where the knee lies.

The bound: every instance busy all the time (perfect balance), every reusable block
reused from the local tier (ideal reuse: an infinite block-level prefix cache over the
trace), no queueing. Each request then costs its new tokens' compute under the cost model,
attention over the cached prefix included, plus the forward overhead amortized over full
chunked-prefill batches::

    seconds per prompt token  s = sum_r [c_lin*n_r + c_attn*n_r*(L_r - n_r/2) + c_fwd*n_r/chunk] / sum_r L_r
    bound (prompt tokens/s)   = instances / s

In ``sessions`` mode (sessions replayed from their start, measured over a window of a
run of ``duration`` seconds) the mix is the trace's requests that start within ~3/4 of the
duration into their session (what a steady-state window sees); in ``compress`` mode the
whole trace. Repeated session copies get distinct KV keys in the simulator, so only the
trace's own reuse counts, as here.

Within the SLO: a request whose own prefill (ideal reuse, idle instance) already exceeds
``ttft_slo(L)`` can never meet it, yet a closed-loop replay must still serve it (its
successors wait for it). So the bound on prefill TPS *within SLO* is the bound above times
the share of prompt tokens in feasible requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from stack.core.cost_model import Hardware
from stack.core.types import SLO
from stack.kv_tier.prefix_cache import PrefixCache
from stack.traces.model import Trace


@dataclass(frozen=True)
class Bound:
    prefill_tps: float  # prompt tokens per second the whole cluster could serve
    seconds_per_token: float  # per instance
    ideal_reuse: float  # of the mix used
    offered_tps_per_rate: float  # prompt tokens/s offered per unit of rate
    rate: float  # the rate at which the offered load reaches the bound
    feasible_token_share: float = 1.0  # prompt tokens of requests that can meet the SLO at all
    feasible_request_share: float = 1.0

    @property
    def prefill_tps_within_slo(self) -> float:
        return self.prefill_tps * self.feasible_token_share

    def as_dict(self) -> dict:
        return {
            "prefill_tps": self.prefill_tps,
            "prefill_tps_within_slo": self.prefill_tps_within_slo,
            "feasible_token_share": self.feasible_token_share,
            "feasible_request_share": self.feasible_request_share,
            "seconds_per_prompt_token": self.seconds_per_token,
            "ideal_reuse": self.ideal_reuse,
            "offered_tps_per_unit_rate": self.offered_tps_per_rate,
            "rate_at_bound": self.rate,
        }


def ideal_hits(trace: Trace) -> list[int]:
    """Per request (trace order), tokens an infinite block-level prefix cache would hit."""
    cache = PrefixCache(None)
    bs = trace.block_size
    out = []
    for r in sorted(trace.requests, key=lambda r: (r.timestamp, r.idx)):
        h = cache.hit(r.path) * bs if r.path else 0
        h = min(h, max(0, r.input_len - 1))
        out.append((r.idx, h))
        if r.path:
            cache.insert(r.path)
    hits = [0] * len(trace.requests)
    for i, h in out:
        hits[i] = h
    return hits


def clairvoyant(
    trace: Trace,
    hw: Hardware,
    instances: int,
    mode: str,
    duration: float,
    hits: list[int] | None = None,
    slo: SLO | None = None,
) -> Bound:
    hits = ideal_hits(trace) if hits is None else hits
    c = hw.cost
    chunk = hw.chunk_tokens
    horizon = 0.75 * duration
    secs = 0.0
    tokens = 0
    reused = 0
    feas_tok = feas_req = n_req = 0
    slo = slo or SLO()
    for r in trace.requests:
        if mode == "sessions" and r.offset > horizon:
            continue
        L = r.input_len
        n = L - hits[r.idx]
        secs += c.c_linear * n + c.c_attn * n * (L - 0.5 * n) + c.c_fwd * n / chunk
        tokens += L
        reused += L - n
        n_req += 1
        if c.cost(n, L) <= slo.ttft(L):
            feas_tok += L
            feas_req += 1
    tokens = max(tokens, 1)
    spt = secs / tokens
    bound = instances / spt if spt > 0 else float("inf")
    if mode == "sessions":
        # a session started `a` seconds ago emits its requests with offset < a; averaged
        # over the window, about the tokens of offsets < 3/4 of the duration per session
        per_rate = tokens / max(1, len(trace.sessions))
    else:
        ts = [r.timestamp for r in trace.requests]
        span = max(ts) - min(ts) if ts else 1.0
        per_rate = sum(r.input_len for r in trace.requests) / max(span, 1e-9)
    rate = bound / per_rate if per_rate > 0 else 1.0
    return Bound(bound, spt, reused / tokens, per_rate, rate, feas_tok / tokens, feas_req / max(1, n_req))
