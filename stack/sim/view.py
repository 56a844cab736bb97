"""What the router sees of the simulated cluster when it routes one request.

The simulator's router view is exact and causal: each instance's queued work, its running
requests (and, colocated, its running decodes and their context), the backlog of its link
and how much of *this* request's prefix its cache holds,
at the moment of the decision (what KV events and load reports would have told a live
router). :func:`build_view` is that rule as one pure function of the instances' figures, so
a test can hold it against the live router's view builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from stack.core.types import ClusterView, InstanceState
from stack.kv_tier.prefix_cache import Path


class _Cache(Protocol):
    def hit(self, path: Path) -> int: ...


class _Link(Protocol):
    free_at: float  # when the link's queued transfers are done (simulated seconds)


class InstanceFigures(Protocol):
    """What the view reads of one simulated instance."""

    cache: _Cache  # its local prefix cache
    q_tokens: int  # new tokens still to prefill (waiting + unfinished chunks)
    q_seconds: float  # their estimated prefill seconds
    n_jobs: int  # requests queued or running
    a_tokens: int  # their whole prompt tokens (cached part included)
    link: _Link  # its global-tier link
    decode_running: int  # requests decoding (PD colocation; 0 under disaggregation)
    decode_tokens: int  # their contexts' sum in tokens
    decode_step_s: float  # seconds their decode adds to each forward


def build_view(
    now: float,
    instances: Sequence[InstanceFigures],
    path: Path,
    prompt_tokens: int,
    block_size: int,
    global_cache: _Cache | None,
    fetch_tokens_per_s: float,
    out: ClusterView | None = None,
) -> ClusterView:
    """The view for routing a request of ``prompt_tokens`` tokens whose prefix is ``path``.

    Hits are in tokens, whole blocks, and capped at ``prompt_tokens - 1``: the last prompt
    token is always computed (it yields the first output token; the rule of
    :func:`~stack.core.types.usable_hit`, inlined here for the hot loop). ``out``: a view of as many
    instances to overwrite in place instead of allocating one (the simulator reuses one
    view for every request; a policy must not keep it past ``choose``).
    """
    if out is None:
        out = ClusterView(
            now=now, instances=[InstanceState(i) for i in range(len(instances))], block_size=block_size
        )
    cap = prompt_tokens - 1 if prompt_tokens > 0 else 0
    for inst, v in zip(instances, out.instances):
        h = inst.cache.hit(path) * block_size if path else 0
        v.local_hit = h if h < cap else cap
        v.queued_tokens = inst.q_tokens
        v.queued_seconds = inst.q_seconds
        # requests from dispatch to finish: under colocation the decoding ones too (0 under PD)
        v.running = inst.n_jobs + inst.decode_running
        v.active_tokens = inst.a_tokens
        fb = inst.link.free_at - now
        v.fetch_backlog_s = fb if fb > 0 else 0.0
        v.decode_running = inst.decode_running
        v.decode_tokens = inst.decode_tokens
        v.decode_step_s = inst.decode_step_s
    g = 0
    if global_cache is not None and path:
        g = global_cache.hit(path) * block_size
        if g > cap:
            g = cap
    out.now = now
    out.global_hit = g
    out.fetch_tokens_per_s = fetch_tokens_per_s
    return out
