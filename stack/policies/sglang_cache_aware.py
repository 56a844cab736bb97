"""``sglang-cache-aware~``: the simulator's stand-in for sglang-router's ``cache_aware``.

`smetric compare` runs sglang-router live and needs a simulated counterpart for each of its
policies; this one approximates ``cache_aware`` (0.3.x, PD prefill side) from what the
simulator's request features carry. It is registered by name (``make_policy``) but is not
one of our router's policies (``POLICIES``): it models someone else's router.

sglang-router keeps, per worker, an approximate radix tree of the request *texts it routed
there* (not the worker's real cache: nothing leaves it but size- and idle-based eviction,
60 s / 64M characters by default). For a request it finds the worker whose tree matches the
longest prefix; if the match rate (matched / request characters) exceeds cache_threshold it
goes there, otherwise to the worker with the smallest tree. Only when the load (requests in
flight) is imbalanced by more than both balance thresholds does it go to the least-loaded
worker instead. In the simulator an agent's follow-up matches its own session's history on
the worker it was last routed to (match rate = est_hit / prompt tokens), prefixes shared
across sessions are too short to pass 0.3, and a tree grows by the tokens it did not match.
"""

from __future__ import annotations

from stack.core.types import ClusterView, Decision, DecisionKind, Request
from stack.policies.base import Policy, PolicyContext, argmin, candidates


class SGLangCacheAwareApprox(Policy):
    name = "sglang-cache-aware~"
    # the worker a session was last routed to stands for the tree holding its history
    needs_session_id = True

    def __init__(
        self,
        ctx: PolicyContext,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        history_visible: float = 1.0,
    ) -> None:
        super().__init__(ctx)
        # history_visible=0: the matched text never holds the conversation history (what
        # sglang-router 0.3.2 does for PD chat completions here, see docs/research/results.md), so
        # every request goes to the smallest tree
        self.history = bool(history_visible)
        self.thr = cache_threshold
        self.abs = balance_abs_threshold
        self.rel = balance_rel_threshold
        self.owner: dict[str, int] = {}  # session -> worker it was last routed to
        self.tree: dict[int, int] = {}  # worker -> tokens in its approximate tree

    def choose(self, req: Request, view: ClusterView) -> Decision:
        insts = candidates(view)
        loads = [s.running for s in insts]
        hi, lo = max(loads), min(loads)
        L = max(1, req.prompt_tokens)
        prev = self.owner.get(req.session_id) if req.session_id is not None else None
        healthy = {s.index for s in insts}
        if hi - lo > self.abs and hi > lo * self.rel:
            i, kind = argmin(insts, lambda s: s.running).index, DecisionKind.BALANCE
        elif self.history and prev in healthy and req.est_hit / L > self.thr:
            i, kind = prev, DecisionKind.STICK
        else:
            i, kind = argmin(insts, lambda s: self.tree.get(s.index, 0)).index, DecisionKind.BALANCE
        self.tree[i] = self.tree.get(i, 0) + L - (req.est_hit if i == prev else 0)
        if req.session_id is not None:
            self.owner[req.session_id] = i
        return Decision(i, kind)
