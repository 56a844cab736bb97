"""llm-d style SLO / latency-predictor routing.

An online-fitted linear model predicts each instance's TTFT for the request from
features the router has (queued prefill seconds, the request's own prefill estimate after
its local hit, running requests). The request goes to the instance with the least
positive headroom among those predicted to meet the TTFT SLO (packing, as llm-d does);
when none is predicted to meet it, to the smallest predicted TTFT.

The model starts at the cost model's own estimate (weights 1, 1, 0, 0) and is refined by
recursive least squares from observed TTFTs (``observe``).
"""

from __future__ import annotations

import numpy as np

from stack.core.types import ClusterView, Decision, DecisionKind, InstanceState, Request
from stack.policies.base import Policy, PolicyContext, candidates


class SLOPredictor(Policy):
    name = "slo-predictor"

    def __init__(self, ctx: PolicyContext, forgetting: float = 0.999) -> None:
        super().__init__(ctx)
        self.w = np.array([1.0, 1.0, 0.0, 0.0])
        self.P = np.eye(4) * 10.0
        self.lam = forgetting
        self.samples = 0

    def feedback(self, req: Request, chosen: InstanceState) -> list[float]:
        """The model's inputs for the chosen instance: [queued s, own prefill s, running, 1]."""
        L = req.prompt_tokens
        own = self.ctx.cost.cost(L - chosen.local_hit, L)
        return [chosen.queued_seconds, own, float(chosen.running), 1.0]

    def predict(self, x: np.ndarray) -> float:
        return float(self.w @ x)

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        slo = self.ctx.slo.ttft(req.prompt_tokens)
        best_fit = None  # (headroom, index)
        best_any = None  # (pred, index)
        w = self.w
        for s in insts:
            L = req.prompt_tokens
            own = self.ctx.cost.cost(L - s.local_hit, L)
            pred = w[0] * s.queued_seconds + w[1] * own + w[2] * s.running + w[3]
            head = slo - pred
            if head > 0 and (best_fit is None or head < best_fit[0]):
                best_fit = (head, s.index)
            if best_any is None or pred < best_any[0]:
                best_any = (pred, s.index)
        chosen = best_fit[1] if best_fit is not None else best_any[1]
        return Decision(chosen, DecisionKind.BALANCE)

    def observe(self, req: Request, instance: int, feedback, ttft: float) -> None:
        x = np.asarray(feedback, dtype=float)
        Px = self.P @ x
        k = Px / (self.lam + x @ Px)
        self.w = self.w + k * (ttft - self.w @ x)
        self.P = (self.P - np.outer(k, Px)) / self.lam
        self.samples += 1
