"""Baseline routing policies (paper §4.1 and §5).

Each keeps its documented defaults. Scores are "lower is better" unless stated.
"""

from __future__ import annotations

import random

from stack.core.types import ClusterView, Decision, DecisionKind, InstanceState, Request
from stack.policies.base import Policy, PolicyContext, argmin, candidates


class RoundRobin(Policy):
    name = "round-robin"
    needs_prompt_features = False

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        s = insts[self._next % len(insts)]
        self._next += 1
        return Decision(s.index, DecisionKind.BALANCE)


class Random(Policy):
    """A uniformly random healthy instance (seeded): what sglang-router 0.3.2's ``cache_aware``
    does in PD mode, where it finds no tree and falls back to random selection."""

    name = "random"
    needs_prompt_features = False

    def __init__(self, ctx: PolicyContext, seed: int = 0) -> None:
        super().__init__(ctx)
        self._rng = random.Random(seed)

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        return Decision(insts[self._rng.randrange(len(insts))].index, DecisionKind.BALANCE)


class LeastLoad(Policy):
    """Join the shortest queue on in-flight prefill tokens (vLLM default style)."""

    name = "least-load"

    def choose(self, req: Request, view: ClusterView) -> Decision:
        s = argmin(candidates(view), lambda s: (s.queued_tokens, s.running))
        return Decision(s.index, DecisionKind.BALANCE)


class Linear(Policy):
    """Production cache-aware ("Bailian"): ``(1-λ)·norm(l_i) + λ·(1 - c_i/L)``."""

    name = "linear"

    def __init__(self, ctx: PolicyContext, lam: float = 0.9) -> None:
        super().__init__(ctx)
        if not 0.0 <= lam <= 1.0:
            raise ValueError("lambda must be in [0, 1]")
        self.lam = lam

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        top = max(1, max(s.running for s in insts))
        L = max(1, req.prompt_tokens)
        lam = self.lam
        s = argmin(insts, lambda s: (1 - lam) * s.running / top + lam * (1 - s.local_hit / L))
        return Decision(s.index, DecisionKind.BALANCE)


class LMetric(Policy):
    """LMetric: ``(q_i + L - c_i) × (l_i + 1)`` in tokens, argmin, ties to the lowest index.

    Checked against the LMetric authors' reference router (blitz-router's ``lmetric-q``:
    ``(max(q, 0) + max(L - hit_blocks·B, 0)) × (bs + 1)``, argmin, first minimum): the same
    rule. Both of our drivers hand whole-block hits capped at ``L - 1`` (``usable_hit``), so
    ``L - c_i`` is never below 1 where theirs can reach 0 for a fully cached prompt, and
    their ``bs`` (requests from dispatch to finish) is our ``running`` in a PD prefill pool.
    """

    name = "lmetric"

    def choose(self, req: Request, view: ClusterView) -> Decision:
        L = req.prompt_tokens
        s = argmin(candidates(view), lambda s: (s.queued_tokens + L - s.local_hit) * (s.running + 1))
        return Decision(s.index, DecisionKind.BALANCE)


class Dynamo(Policy):
    """Dynamo KV router: ``w·prefill_blocks_i + decode_blocks_i`` (w = 1), argmin.

    prefill blocks = blocks still to prefill on the instance (queued) plus this request's
    new blocks after its local overlap.
    """

    name = "dynamo"

    def __init__(self, ctx: PolicyContext, overlap_weight: float = 1.0) -> None:
        super().__init__(ctx)
        self.w = overlap_weight

    def choose(self, req: Request, view: ClusterView) -> Decision:
        bs = max(1, view.block_size)
        L = req.prompt_tokens

        def score(s: InstanceState) -> float:
            prefill_blocks = (s.queued_tokens + L - s.local_hit) / bs
            return self.w * prefill_blocks + s.decode_tokens / bs

        s = argmin(candidates(view), score)
        return Decision(s.index, DecisionKind.BALANCE)


class Preble(Policy):
    """Preble as in AIBrix: load filter, then prefix match, else least estimated work."""

    name = "preble"

    def __init__(self, ctx: PolicyContext, spread: int = 8, match_ratio: float = 0.5) -> None:
        super().__init__(ctx)
        self.spread = spread
        self.match_ratio = match_ratio

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = list(candidates(view))
        lo = min(s.running for s in insts)
        hi = max(s.running for s in insts)
        if hi - lo > self.spread:
            insts = [s for s in insts if s.running == lo]
        L = max(1, req.prompt_tokens)
        best_hit = max(s.local_hit for s in insts)
        if best_hit / L > self.match_ratio:
            holders = [s for s in insts if s.local_hit == best_hit]
            s = argmin(holders, lambda s: (s.running, s.queued_tokens))
            return Decision(s.index, DecisionKind.BALANCE)
        cost = self.ctx.cost
        s = argmin(insts, lambda s: s.queued_seconds + cost.cost(L - s.local_hit, L) + s.decode_tokens * 1e-6)
        return Decision(s.index, DecisionKind.BALANCE)


class SessionAffinity(Policy):
    """llm-d session affinity: stick to the session's instance; new sessions to least load."""

    name = "session"
    needs_session_id = True

    def __init__(self, ctx: PolicyContext, max_sessions: int = 1_000_000) -> None:
        super().__init__(ctx)
        self.table: dict[str, int] = {}
        self.max_sessions = max_sessions

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        healthy = {s.index for s in insts}
        sid = req.session_id
        known = sid is not None and sid in self.table
        if known:
            i = self.table[sid]
            if i in healthy:
                return Decision(i, DecisionKind.STICK)
        s = argmin(insts, lambda s: (s.queued_tokens, s.running))
        if sid is not None:
            if len(self.table) >= self.max_sessions:
                self.table.pop(next(iter(self.table)))
            self.table[sid] = s.index
        kind = DecisionKind.MIGRATE if known else DecisionKind.FIRST_TURN
        return Decision(s.index, kind)

    def forget(self, instance: int) -> None:
        self.table = {k: v for k, v in self.table.items() if v != instance}


class Bailian(Policy):
    """The production cache-aware ("Bailian") scheduler as the LMetric authors' reference router
    ships it (blitz-router ``bailian-impl-q``): a weighted random choice.

    Per instance, three terms min-max normalised over the candidates (ε = 1e-6, clamped to
    [0, 1]): the hit ratio ``c_i / L`` (higher is better), the batch size ``running`` and the
    KV footprint ``active_tokens`` (fewer is better); ``p_i = α·hit + β·batch + γ·tokens``
    with α, β, γ = 0.7, 0.15, 0.15 (its defaults). The instance is drawn with probability
    ``p_i / Σp`` (seeded here; unseeded there); when every ``p_i`` is 0 (all instances alike,
    or one is worst on every term and the rest tie) the first candidate gets it, as there.
    Today's deterministic two-term ``linear`` stays, with its published figures.
    """

    name = "bailian"

    def __init__(
        self, ctx: PolicyContext, alpha: float = 0.7, beta: float = 0.15, gamma: float = 0.15, seed: int = 0
    ) -> None:
        super().__init__(ctx)
        if min(alpha, beta, gamma) < 0:
            raise ValueError("alpha, beta and gamma must be >= 0")
        self.w = (float(alpha), float(beta), float(gamma))
        self._rng = random.Random(seed)

    @staticmethod
    def _norm(values: list[float], higher_better: bool) -> list[float]:
        lo, hi = min(values), max(values)
        span = max(hi - lo, 1e-6)
        out = []
        for v in values:
            x = (v - lo) / span if higher_better else (hi - v) / span
            out.append(0.0 if x < 0.0 else 1.0 if x > 1.0 else x)
        return out

    def weights(self, req: Request, insts: list[InstanceState]) -> list[float]:
        """Each candidate's ``p_i`` (0 where not positive)."""
        L = req.prompt_tokens
        hit = self._norm([s.local_hit / L if L > 0 else 0.0 for s in insts], True)
        bs = self._norm([float(s.running) for s in insts], False)
        tok = self._norm([float(s.active_tokens) for s in insts], False)
        a, b, g = self.w
        ps = [a * h + b * n + g * t for h, n, t in zip(hit, bs, tok)]
        return [p if p > 0.0 and p == p and p != float("inf") else 0.0 for p in ps]

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = list(candidates(view))
        ps = self.weights(req, insts)
        total = sum(ps)
        if total <= 0.0:
            return Decision(insts[0].index, DecisionKind.BALANCE)
        r = self._rng.random() * total
        for s, p in zip(insts, ps):
            r -= p
            if r < 0.0:
                return Decision(s.index, DecisionKind.BALANCE)
        return Decision(insts[-1].index, DecisionKind.BALANCE)
