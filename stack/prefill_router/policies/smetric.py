"""SMetric: balanced session-centric prefill routing (paper §4.2, Fig. 13).

Reading of the paper used here (faithful variant, ``smetric``)::

    best = argmax_i c_i                                   # instance holding the session
    if turn > 1 and c_best >= HIT_RATIO * est_hit:        # a follow-up still cached locally
        if meets_ttft(best): return best                  # stick
    return least_loaded()                                 # first turn / evicted / migrate

    least_loaded(): argmin_i q_i + cost(L - c_i, L)       # KV-aware balance
    meets_ttft(i):  q_i + cost(L - c_i, L) <= SLACK * ttft_slo(L)

Variants (named, so the simulator can compare them):

- ``smetric-b``: reading B of the fallback: migrate only to an instance that meets the
  deadline; if none does, stay on ``best`` (the highest hit adds the least new work).
- ``smetric-basic``: session-centric only, never migrates (ablation step 1).
- ``smetric-load``: migrates when the sticky instance's queued work exceeds the cluster
  mean by a margin (ablation step 2).
- ``smetric-tokens``: SLO migration with a token-count load estimate (ablation step 3).
- ``smetric-global``: counts global-tier hits and their fetch time in ``least_loaded`` and
  ``meets_ttft`` (our improvement: a migrated session's KV is not recomputed).
"""

from __future__ import annotations

import math

from stack.prefill_router.policies.base import Policy, PolicyContext, argmin, candidates
from stack.prefill_router.types import ClusterView, Decision, DecisionKind, InstanceState, Request


class SMetric(Policy):
    name = "smetric"

    def __init__(
        self,
        ctx: PolicyContext,
        hit_ratio: float = 0.8,
        slack: float = 1.0,
        fallback: str = "least_loaded",
        migration: str = "slo",
        load_margin: float = 0.5,
        count_global: bool = False,
    ) -> None:
        super().__init__(ctx)
        if not 0.0 <= hit_ratio <= 1.0:
            raise ValueError("hit_ratio must be in [0, 1]")
        if slack < 0:
            raise ValueError("slack must be >= 0")
        if fallback not in ("least_loaded", "stay"):
            raise ValueError("fallback must be least_loaded or stay")
        if migration not in ("slo", "none", "load", "tokens"):
            raise ValueError("migration must be slo, none, load or tokens")
        self.hit_ratio = hit_ratio
        self.slack = slack
        self.fallback = fallback
        self.migration = migration
        self.load_margin = load_margin
        self.count_global = count_global

    # -- the decision, as in the paper's pseudo-code -------------------------------------
    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        best = max(insts, key=lambda s: (s.local_hit, -s.index))
        if req.turn > 1 and best.local_hit > 0 and best.local_hit >= self.hit_ratio * req.est_hit:
            if self.meets_ttft(best, req, view, insts):
                return Decision(best.index, DecisionKind.STICK)
            if self.fallback == "stay":
                ok = [s for s in insts if self.meets_ttft(s, req, view, insts)]
                if not ok:
                    return Decision(best.index, DecisionKind.STICK)
                target = argmin(ok, lambda s: self.load(s, req, view))
            else:
                target = self.least_loaded(req, view, insts)
            kind = DecisionKind.STICK if target.index == best.index else DecisionKind.MIGRATE
            return Decision(target.index, kind)
        return Decision(self.least_loaded(req, view, insts).index, DecisionKind.FIRST_TURN)

    # -- helpers -------------------------------------------------------------------------
    def hit(self, s: InstanceState, view: ClusterView) -> tuple[int, float]:
        """Reusable tokens on ``s`` and the seconds to fetch the part that is not local."""
        if self.count_global and view.global_hit > s.local_hit and view.fetch_tokens_per_s > 0:
            fetch = s.fetch_backlog_s + (view.global_hit - s.local_hit) / view.fetch_tokens_per_s
            return view.global_hit, fetch
        return s.local_hit, 0.0

    def load(self, s: InstanceState, req: Request, view: ClusterView) -> float:
        """Estimated TTFT on ``s``: queued prefill seconds + this request's prefill."""
        L = req.prompt_tokens
        hit, fetch = self.hit(s, view)
        own = self.ctx.cost.cost(L - hit, L)
        if self.count_global:
            # the fetch overlaps with queueing: the request waits for the longer of the two
            return max(s.queued_seconds, fetch) + own
        return s.queued_seconds + own

    def least_loaded(self, req: Request, view: ClusterView, insts) -> InstanceState:
        return argmin(insts, lambda s: self.load(s, req, view))

    def meets_ttft(self, s: InstanceState, req: Request, view: ClusterView, insts) -> bool:
        if self.migration == "none":
            return True
        if self.migration == "load":
            mean = sum(i.queued_tokens for i in insts) / len(insts)
            return s.queued_tokens <= (1.0 + self.load_margin) * mean
        deadline = self.slack * self.ctx.slo.ttft(req.prompt_tokens)
        if math.isinf(deadline):
            return True
        if self.migration == "tokens":
            # token counts at the linear prefill rate, attention ignored
            work = s.queued_tokens + req.prompt_tokens - s.local_hit
            return work * self.ctx.cost.c_linear + self.ctx.cost.c_fwd <= deadline
        return self.load(s, req, view) <= deadline


def make_variant(name: str, ctx: PolicyContext, **kw) -> SMetric:
    presets = {
        "smetric": {},
        "smetric-b": {"fallback": "stay"},
        "smetric-basic": {"migration": "none"},
        "smetric-load": {"migration": "load"},
        "smetric-tokens": {"migration": "tokens"},
        "smetric-global": {"count_global": True},
        "smetric-global-b": {"count_global": True, "fallback": "stay"},
    }
    args = {**presets[name], **kw}
    p = SMetric(ctx, **args)
    p.name = name
    return p


VARIANTS = (
    "smetric",
    "smetric-b",
    "smetric-basic",
    "smetric-load",
    "smetric-tokens",
    "smetric-global",
    "smetric-global-b",
)
