"""llm-d's agentic prefill rule, as its agentic-serving guide configures the prefill profile.

The guide's prefill profile is a prefix-cache affinity *filter* and a token-load *scorer*,
with llm-d's default picker (highest score, ties broken at random). Our reading of
llm-d-router's plugins (prefixcacheaffinity filter, tokenload scorer, inflightload producer):

1. Holders H: instances whose cached prefix covers at least ``affinity_threshold`` (0.8) of
   the request's blocks. No holder: every instance stays.
2. The gate: each instance's TTFT penalty is its in-flight uncached tokens over a peak
   prefill throughput V. When the best holder's penalty exceeds the best non-holder's by
   more than ``max_ttft_penalty_s`` (18 s, the plugin default since mid-2026; it was 5 s),
   stickiness is broken and every instance stays; otherwise only H does. The request's own
   tokens are not in this estimate (upstream leaves them out).
3. Score: ``1 - min(1, (in-flight + this request's uncached tokens) / Q)`` with
   Q = 4,194,304 tokens; the highest score wins, ties at random (seeded here).

In-flight tokens are our ``queued_tokens``: live, exactly what llm-d counts (uncached
prompt tokens booked at dispatch, released when the prefill answers); in the simulator the
unfinished part, which also shrinks as chunks complete (llm-d's figure does not).
V defaults to what llm-d's calibration measures, the prefill rate of one unloaded
8,192-token chunk, taken from our cost model: ~13,961 tok/s on H20, ~51,651 on H200.
"""

from __future__ import annotations

import random

from stack.core.types import ClusterView, Decision, DecisionKind, InstanceState, Request
from stack.policies.base import Policy, PolicyContext, candidates

CALIBRATION_CHUNK = 8192


def peak_prefill_tps(ctx: PolicyContext, chunk: int = CALIBRATION_CHUNK) -> float:
    """Tokens per second of one unloaded ``chunk``-token prefill under the cost model."""
    return chunk / ctx.cost.cost(chunk, chunk)


class LLMDAgentic(Policy):
    name = "llm-d-agentic"

    def __init__(
        self,
        ctx: PolicyContext,
        affinity_threshold: float = 0.8,
        max_ttft_penalty_s: float = 18.0,
        peak_tps: float | None = None,
        queue_threshold_tokens: float = 4_194_304,
        seed: int = 0,
    ) -> None:
        super().__init__(ctx)
        if not 0.0 <= affinity_threshold <= 1.0:
            raise ValueError("affinity_threshold must be in [0, 1]")
        if max_ttft_penalty_s < 0 or queue_threshold_tokens <= 0:
            raise ValueError("max_ttft_penalty_s must be >= 0 and queue_threshold_tokens > 0")
        self.threshold = float(affinity_threshold)
        self.max_penalty_s = float(max_ttft_penalty_s)
        self.peak_tps = float(peak_tps) if peak_tps else peak_prefill_tps(ctx)
        self.q = float(queue_threshold_tokens)
        self._rng = random.Random(seed)

    def holders(self, req: Request, insts: list[InstanceState]) -> list[InstanceState]:
        """Instances whose cached blocks cover at least the threshold of the request's blocks."""
        bs = self.ctx.block_size
        total = req.prompt_tokens // bs
        if total <= 0 or self.threshold <= 0:
            return []
        return [s for s in insts if (s.local_hit // bs) / total >= self.threshold]

    def filter(self, req: Request, insts: list[InstanceState]) -> list[InstanceState]:
        """The affinity filter: the holders, unless sticking costs more than the maximum."""
        if len(insts) <= 1:
            return insts
        held = self.holders(req, insts)
        if not held:
            return insts
        ids = {s.index for s in held}
        others = [s for s in insts if s.index not in ids]
        if self.max_penalty_s > 0 and others:
            best_held = min(s.queued_tokens for s in held) / self.peak_tps
            best_other = min(s.queued_tokens for s in others) / self.peak_tps
            if best_held - best_other > self.max_penalty_s:
                return insts  # stickiness broken: everyone goes to the scorer
        return held

    def score(self, req: Request, s: InstanceState) -> float:
        tokens = s.queued_tokens + max(0, req.prompt_tokens - s.local_hit)
        return 1.0 - min(1.0, tokens / self.q) if tokens > 0 else 1.0

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = list(candidates(view))
        kept = self.filter(req, insts)
        scores = [self.score(req, s) for s in kept]
        top = max(scores)
        best = [s for s, sc in zip(kept, scores) if sc == top]
        chosen = best[self._rng.randrange(len(best))] if len(best) > 1 else best[0]
        if req.turn <= 1:
            return Decision(chosen.index, DecisionKind.FIRST_TURN)
        held = self.holders(req, insts)
        if not held:
            return Decision(chosen.index, DecisionKind.BALANCE)
        kind = DecisionKind.STICK if chosen.index in {s.index for s in held} else DecisionKind.MIGRATE
        return Decision(chosen.index, kind)
