"""SMetric: balanced session-centric prefill routing (paper §4.2, Fig. 13).

Reading of the paper used here (faithful variant, ``smetric``)::

    best = argmax_i c_i                                   # instance holding the session
    if turn > 1 and c_best >= HIT_RATIO * est_hit:        # a follow-up still cached locally
        if meets_ttft(best): return best                  # stick
    return least_loaded()                                 # first turn / evicted / migrate

    least_loaded(): argmin_i q_i + cost(L - c_i, L)       # KV-aware balance
    meets_ttft(i):  q_i + cost(L - c_i, L) <= SLACK * ttft_slo(L)

:meth:`SMetric.choose` is that listing. What the variants change is not tested inside it:
each variant is the same decision composed from three small parts, chosen at construction
(in the spirit of llm-d's filter / scorer / picker plugins, but plain objects with one
method, because the simulator calls ``choose`` tens of thousands of times a second):

- a :class:`TTFTEstimator`: the seconds until the request's first token on an instance,
  the ``q_i + cost(L - c_i, L)`` that both ``least_loaded`` and the SLO check use
  (:class:`LocalTTFT`, or :class:`GlobalTierTTFT` that also counts global-tier hits, their
  fetch time and the link's backlog; under PD colocation either is wrapped in
  :class:`DecodeAwareTTFT`, which adds the decode work every forward carries);
- a :class:`MigrationRule`: ``meets_ttft``, i.e. when a follow-up may stay where its session
  is (:class:`SLODeadline`, and the ablation's :class:`NoMigration`, :class:`LoadMargin`,
  :class:`TokenDeadline`);
- a :class:`Fallback`: where a follow-up goes when sticking fails the rule (reading A,
  :class:`LeastLoaded`; reading B, :class:`OnTimeOrStay`).

Registered variants (:data:`PRESETS`), as the ``policy_params`` that select their parts:

- ``smetric``: local estimate, SLO rule on the cost model, reading A.
- ``smetric-b``: reading B of the fallback: migrate only to an instance that meets the
  deadline; if none does, stay on ``best`` (the highest hit adds the least new work).
- ``smetric-basic``: session-centric only, never migrates (ablation step 1).
- ``smetric-load``: migrates when the sticky instance's queued work exceeds the cluster
  mean by a margin (ablation step 2).
- ``smetric-tokens``: SLO migration with a token-count load estimate (ablation step 3).
- ``smetric-global`` / ``smetric-global-b``: count global-tier hits and their fetch time in
  ``least_loaded`` and ``meets_ttft`` (our improvement: a migrated session's KV is not
  recomputed), with reading A / B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from stack.core.cost_model import CostModel
from stack.core.types import SLO, ClusterView, Decision, DecisionKind, InstanceState, Request
from stack.policies.base import Policy, PolicyContext, argmin, candidates

#: The candidates of one decision (healthy instances), as the parts receive them.
Insts = Sequence[InstanceState]


# -- part 1: the TTFT estimate (what "load" means in least_loaded and meets_ttft) ---------
class TTFTEstimator(Protocol):
    def estimate(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        """Estimated seconds until ``req``'s first token if routed to ``s``."""
        ...


class LocalTTFT:
    """``q_i + cost(L - c_i, L)``: the paper's estimate, which only credits local hits, so a
    session's KV held only in the global tier counts as a full recompute elsewhere."""

    __slots__ = ("_cost",)

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost.cost  # bound once: this runs per instance per decision

    def estimate(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        L = req.prompt_tokens
        return s.queued_seconds + self._cost(L - s.local_hit, L)


class GlobalTierTTFT:
    """Our improvement: a prefix in the global tier is fetched, not recomputed. Where the
    global hit exceeds the local one (and there is a link), the reusable prefix is the global
    hit and its missing part costs a fetch behind the link's backlog. The fetch overlaps with
    queueing, so the request waits for the longer of the two before its own prefill."""

    __slots__ = ("_cost",)

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost.cost

    def estimate(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        L = req.prompt_tokens
        hit, fetch = s.local_hit, 0.0
        if view.global_hit > hit and view.fetch_tokens_per_s > 0:
            fetch = s.fetch_backlog_s + (view.global_hit - hit) / view.fetch_tokens_per_s
            hit = view.global_hit
        return max(s.queued_seconds, fetch) + self._cost(L - hit, L)


class DecodeAwareTTFT:
    """PD colocation (``PolicyContext.colocated``): an instance's running decodes ride in
    every forward it runs, each adding ``decode_step_s`` (their attention over their
    contexts), so the request's first token also waits for that on each forward before it
    (the queued prefill tokens) and of its own prefill, ``ceil((q_tokens + L - c_i) /
    chunk)`` forwards (at least one). Without decodes it is the wrapped estimate."""

    __slots__ = ("_chunk", "_inner")

    def __init__(self, inner: TTFTEstimator, chunk_tokens: int) -> None:
        self._inner = inner.estimate
        self._chunk = max(1, chunk_tokens)

    def estimate(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        est = self._inner(s, req, view)
        d = s.decode_step_s
        if d <= 0:
            return est
        work = s.queued_tokens + req.prompt_tokens - s.local_hit
        forwards = -(-work // self._chunk) if work > 0 else 1
        return est + (forwards if forwards > 1 else 1) * d


# -- part 2: the migration rule (meets_ttft; the ablation swaps it) -----------------------
class MigrationRule(Protocol):
    def meets(self, s: InstanceState, req: Request, view: ClusterView, insts: Insts) -> bool:
        """Whether ``s`` may take ``req`` (for the sticky instance: whether to stay);
        ``insts`` are the candidates, for rules that compare with the cluster."""
        ...


class SLODeadline:
    """Faithful ``meets_ttft``: the estimated TTFT within ``SLACK * ttft_slo(L)``. An infinite
    deadline (SLACK = inf) always holds, without estimating anything."""

    __slots__ = ("_estimate", "_ttft", "slack")

    def __init__(self, slo: SLO, slack: float, estimator: TTFTEstimator) -> None:
        self.slack = slack
        self._ttft = slo.ttft
        self._estimate = estimator.estimate

    def meets(self, s: InstanceState, req: Request, view: ClusterView, insts: Insts) -> bool:
        deadline = self.slack * self._ttft(req.prompt_tokens)
        if math.isinf(deadline):
            return True
        return self._estimate(s, req, view) <= deadline


class TokenDeadline:
    """Ablation step 3: the SLO check on token counts at the linear prefill rate (attention
    and global-tier hits ignored), the estimate the paper's cost model then replaces."""

    __slots__ = ("_c_fwd", "_c_linear", "_ttft", "slack")

    def __init__(self, slo: SLO, slack: float, cost: CostModel) -> None:
        self.slack = slack
        self._ttft = slo.ttft
        self._c_linear = cost.c_linear
        self._c_fwd = cost.c_fwd

    def meets(self, s: InstanceState, req: Request, view: ClusterView, insts: Insts) -> bool:
        deadline = self.slack * self._ttft(req.prompt_tokens)
        if math.isinf(deadline):
            return True
        work = s.queued_tokens + req.prompt_tokens - s.local_hit
        return work * self._c_linear + self._c_fwd <= deadline


class LoadMargin:
    """Ablation step 2: stay while the instance's queued tokens are within ``1 + margin``
    times the cluster mean (a load threshold instead of the SLO)."""

    __slots__ = ("margin",)

    def __init__(self, margin: float) -> None:
        self.margin = margin

    def meets(self, s: InstanceState, req: Request, view: ClusterView, insts: Insts) -> bool:
        mean = sum(i.queued_tokens for i in insts) / len(insts)
        return s.queued_tokens <= (1.0 + self.margin) * mean


class NoMigration:
    """Ablation step 1 (basic session-centric): a follow-up always stays with its session."""

    __slots__ = ()

    def meets(self, s: InstanceState, req: Request, view: ClusterView, insts: Insts) -> bool:
        return True


# -- part 3: the fallback when sticking fails the rule (the two readings) -----------------
class Fallback(Protocol):
    def target(
        self, p: SMetric, best: InstanceState, req: Request, view: ClusterView, insts: Insts
    ) -> InstanceState:
        """Where the follow-up goes once ``best`` (its session's instance) failed the rule;
        ``best`` itself is allowed (then it is counted as a stick)."""
        ...


class LeastLoaded:
    """Reading A: the KV-aware least-loaded instance, whether or not it meets the deadline
    (``best`` wins where its hit saves more than its queue costs)."""

    __slots__ = ()

    def target(
        self, p: SMetric, best: InstanceState, req: Request, view: ClusterView, insts: Insts
    ) -> InstanceState:
        return p.least_loaded(req, view, insts)


class OnTimeOrStay:
    """Reading B: the least loaded of the instances that meet the rule; when none does, stay
    on ``best``, whose hit adds the least new work to an overloaded cluster."""

    __slots__ = ()

    def target(
        self, p: SMetric, best: InstanceState, req: Request, view: ClusterView, insts: Insts
    ) -> InstanceState:
        ok = [s for s in insts if p.meets_ttft(s, req, view, insts)]
        return p.least_loaded(req, view, ok) if ok else best


def _most_local_hit(s: InstanceState) -> tuple[int, int]:
    return s.local_hit, -s.index  # ties: the lowest index


# -- the policy --------------------------------------------------------------------------
class SMetric(Policy):
    """The paper's decision over injected parts (defaults: the faithful ``smetric``).

    ``estimate``, ``meets_ttft`` are the injected parts' methods bound once at construction,
    under the paper's names, so a decision costs no more calls than inlined code would.
    """

    name = "smetric"

    def __init__(
        self,
        ctx: PolicyContext,
        hit_ratio: float = 0.8,
        *,
        estimator: TTFTEstimator | None = None,
        rule: MigrationRule | None = None,
        fallback: Fallback | None = None,
    ) -> None:
        super().__init__(ctx)
        _check_hit_ratio(hit_ratio)
        self.hit_ratio = hit_ratio
        if estimator is None:
            estimator = LocalTTFT(ctx.cost)
            if ctx.colocated:
                estimator = DecodeAwareTTFT(estimator, ctx.chunk_tokens)
        self.estimator: TTFTEstimator = estimator
        self.rule: MigrationRule = SLODeadline(ctx.slo, 1.0, self.estimator) if rule is None else rule
        self.fallback: Fallback = LeastLoaded() if fallback is None else fallback
        self.estimate: Callable[[InstanceState, Request, ClusterView], float] = self.estimator.estimate
        self.meets_ttft: Callable[[InstanceState, Request, ClusterView, Insts], bool] = self.rule.meets

    @classmethod
    def from_params(
        cls,
        ctx: PolicyContext,
        hit_ratio: float = 0.8,
        slack: float = 1.0,
        fallback: str = "least_loaded",
        migration: str = "slo",
        load_margin: float = 0.5,
        count_global: bool = False,
    ) -> SMetric:
        """Build from ``policy_params`` (``--param``, the router config): each parameter names
        or tunes a part. The names' checks come first, before any part is built."""
        _check_hit_ratio(hit_ratio)
        if slack < 0:
            raise ValueError("slack must be >= 0")
        if fallback not in FALLBACKS:
            raise ValueError("fallback must be least_loaded or stay")
        if migration not in MIGRATION_RULES:
            raise ValueError("migration must be slo, none, load or tokens")
        estimator: TTFTEstimator = GlobalTierTTFT(ctx.cost) if count_global else LocalTTFT(ctx.cost)
        if ctx.colocated:
            estimator = DecodeAwareTTFT(estimator, ctx.chunk_tokens)
        if migration == "slo":
            rule: MigrationRule = SLODeadline(ctx.slo, slack, estimator)
        elif migration == "tokens":
            rule = TokenDeadline(ctx.slo, slack, ctx.cost)
        elif migration == "load":
            rule = LoadMargin(load_margin)
        else:
            rule = NoMigration()
        return cls(ctx, hit_ratio, estimator=estimator, rule=rule, fallback=FALLBACKS[fallback]())

    # -- the decision, as in the paper's pseudo-code -------------------------------------
    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        best = max(insts, key=_most_local_hit)  # the instance that likely served the session
        if not (req.turn > 1 and self.holds_session(best, req)):  # first turn, or evicted
            return Decision(self.least_loaded(req, view, insts).index, DecisionKind.FIRST_TURN)
        if self.meets_ttft(best, req, view, insts):  # sticking is on time: stick
            return Decision(best.index, DecisionKind.STICK)
        target = self.fallback.target(self, best, req, view, insts)  # migrate (reading A / B)
        kind = DecisionKind.STICK if target.index == best.index else DecisionKind.MIGRATE
        return Decision(target.index, kind)

    # -- the listing's helpers -----------------------------------------------------------
    def holds_session(self, best: InstanceState, req: Request) -> bool:
        """``best`` still caches enough of the session's history (``HIT_RATIO * est_hit``)
        to be the instance that served its previous turn; otherwise it was evicted."""
        return best.local_hit > 0 and best.local_hit >= self.hit_ratio * req.est_hit

    def least_loaded(self, req: Request, view: ClusterView, insts: Insts) -> InstanceState:
        """KV-aware balance: the smallest estimated TTFT (ties: the first candidate)."""
        estimate = self.estimate
        return argmin(insts, lambda s: estimate(s, req, view))


def _check_hit_ratio(hit_ratio: float) -> None:
    if not 0.0 <= hit_ratio <= 1.0:
        raise ValueError("hit_ratio must be in [0, 1]")


#: ``fallback=`` values of :meth:`SMetric.from_params`.
FALLBACKS: dict[str, type[LeastLoaded] | type[OnTimeOrStay]] = {
    "least_loaded": LeastLoaded,
    "stay": OnTimeOrStay,
}
#: ``migration=`` values of :meth:`SMetric.from_params`.
MIGRATION_RULES: tuple[str, ...] = ("slo", "none", "load", "tokens")

#: Each registered variant as the parameters that select its parts; ``policy_params``
#: given to :func:`make_variant` override them (e.g. ``smetric`` with ``slack=1.5``).
PRESETS: dict[str, dict[str, object]] = {
    "smetric": {},
    "smetric-b": {"fallback": "stay"},
    "smetric-basic": {"migration": "none"},
    "smetric-load": {"migration": "load"},
    "smetric-tokens": {"migration": "tokens"},
    "smetric-global": {"count_global": True},
    "smetric-global-b": {"count_global": True, "fallback": "stay"},
}

VARIANTS: tuple[str, ...] = tuple(PRESETS)


def make_variant(name: str, ctx: PolicyContext, **kw) -> SMetric:
    """The registered variant ``name`` with ``kw`` (policy_params) over its preset."""
    p = SMetric.from_params(ctx, **{**PRESETS[name], **kw})
    p.name = name
    return p
