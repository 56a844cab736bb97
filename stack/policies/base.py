"""The one routing interface: ``choose(request, view) -> Decision``.

Policies are pure functions of the request features and the cluster view, plus (for a few
baselines) small internal state such as a round-robin pointer or a session table. They
never do I/O, so the live router and the simulator run the very same objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stack.core.cost_model import CostModel
from stack.core.types import SLO, ClusterView, Decision, InstanceState, Request


@dataclass(slots=True)
class PolicyContext:
    """What a policy may know about the deployment (not per request)."""

    cost: CostModel
    slo: SLO
    block_size: int = 64
    # PD colocation: instances also decode (InstanceState.decode_*), so every prefill
    # forward carries their decode work; ``chunk_tokens`` counts those forwards
    colocated: bool = False
    chunk_tokens: int = 8192


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`choose`."""

    name: str = "policy"
    #: True when the policy needs ``Request.session_id`` (llm-d session affinity).
    needs_session_id: bool = False
    #: False when the policy reads nothing derived from the prompt's text (tokens, hits,
    #: turn, est_hit): the live router then skips tokenization, and ``prompt_tokens`` is an
    #: estimate from the body's size (see ``stack.prefill_router.api.parse``).
    needs_prompt_features: bool = True

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def choose(self, req: Request, view: ClusterView) -> Decision:  # pragma: no cover
        raise NotImplementedError

    def feedback(self, req: Request, chosen: InstanceState) -> Sequence[float] | None:
        """What this policy wants handed back to :meth:`observe` for ``req`` routed to
        ``chosen``, read from the view at routing time. ``None`` (the default): the policy
        learns nothing and drivers skip the feedback path. Both drivers call it the same way:
        right after :meth:`choose`, on the chosen instance's state."""
        return None

    def observe(self, req: Request, instance: int, feedback: Sequence[float], ttft: float) -> None:
        """After ``req``'s first token: what :meth:`feedback` returned at routing time and the
        observed TTFT (used by learning policies). Only called when feedback was not None."""

    def forget(self, instance: int) -> None:
        """An instance left the pool (ejected or removed)."""


def candidates(view: ClusterView) -> Sequence[InstanceState]:
    """Healthy instances (all of them if none is marked healthy, to never route nowhere)."""
    inst = [s for s in view.instances if s.healthy]
    if not inst:
        raise NoInstanceError("no healthy prefill instance")
    return inst


class NoInstanceError(RuntimeError):
    """No instance can take the request (the HTTP router answers 503)."""


def argmin(items: Sequence[InstanceState], key: Callable[[InstanceState], float]) -> InstanceState:
    """The item with the smallest key; ties go to the lowest index (deterministic)."""
    best = items[0]
    best_k = key(best)
    for s in items[1:]:
        k = key(s)
        if k < best_k:
            best, best_k = s, k
    return best
