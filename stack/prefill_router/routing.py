"""Choose a prefill worker for one request and book it: features in, a booked request out.

The order is fixed: read the cluster (prefix index, global tier, and with router replicas
the others' figures), let the policy choose, claim the choice (replicas: a compare-and-set
in Redis; a lost claim chooses again on the fresh figures), then book the prefill and the
decode worker in the pool. Every await is in :meth:`PrefillRouter._choose`; :meth:`_book`
is synchronous and runs right after the last claim returns, so no other request can run
between a won claim and the local accounting that covers it (the shared state's rule).

The booked request comes back as a :class:`~stack.prefill_router.routed.Routed`, which
records the rest of its life (routing history, prefill done, first token, failure, release).
No web framework here: the HTTP layer maps :class:`NoWorker` to a 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stack.core.cost_model import CostModel, DecodeCost
from stack.core.types import DecisionKind, InstanceState
from stack.core.types import Request as PRequest
from stack.decode_router.balancer import pick_decode
from stack.kv_tier.index import PrefixIndex
from stack.policies import NoInstanceError, Policy
from stack.pool import Worker, WorkerRegistry
from stack.prefill_router.features import Features
from stack.prefill_router.routed import Routed
from stack.prefill_router.session_hints import HintTracker
from stack.prefill_router.view import build_view

if TYPE_CHECKING:
    from stack.prefill_router.shared_state import SharedState


class NoWorker(Exception):
    """No healthy worker of ``role`` ("prefill" or "decode") can take the request."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no {role} worker available")
        self.role = role


@dataclass(slots=True)
class _Choice:
    worker: Worker
    kind: DecisionKind
    state: InstanceState  # the chosen worker's state in the view the policy chose on
    seconds: float  # the request's own estimated prefill seconds on the worker
    global_hit: int  # tokens
    feedback: Sequence[float] | None  # Policy.feedback on the chosen worker's state


class PrefillRouter:
    """The routing step of the live router, over one pool, index, global tier and policy."""

    def __init__(
        self,
        registry: WorkerRegistry,
        index: PrefixIndex,
        global_tier,
        policy: Policy,
        cost: CostModel,
        block_size: int,
        fetch_tokens_per_s: float,
        shared: SharedState | None = None,
        decode_cost: DecodeCost | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``decode_cost``: PD colocation (the prefill workers decode too): the view carries
        each worker's running decodes priced with it (:func:`build_view`); None under PD.
        ``clock``: the pool's clock (router.time_factor), on which each worker's link backlog
        is kept: a booked request that fetches part of its prefix from the global tier queues
        that fetch on its worker's link (:meth:`Worker.fetch_booked`), and the view carries
        the backlog (``fetch_backlog_s``)."""
        self.clock = clock
        self.decode_cost = decode_cost
        self.registry = registry
        self.index = index
        self.global_tier = global_tier
        self.policy = policy
        self.cost = cost
        self.block_size = block_size
        self.fetch_tps = fetch_tokens_per_s
        self.shared = shared
        #: session id -> its last prefill worker (hinted requests; only a metric reads it)
        self.hints = HintTracker()

    def request_of(self, f: Features) -> PRequest:
        """The policy's view of the request; the session id only for a policy that asks."""
        sid = f.session_id if self.policy.needs_session_id else None
        return PRequest(f.prompt_tokens, f.turn, f.est_hit, sid)

    async def route(self, f: Features, exclude_p: set[int], exclude_d: set[int], with_decode: bool) -> Routed:
        """Choose and book a prefill worker not in ``exclude_p`` and, ``with_decode``, a
        decode worker not in ``exclude_d``. Raises :class:`NoWorker`."""
        req = self.request_of(f)
        choice = await self._choose(f, req, exclude_p)
        return self._book(f, req, choice, exclude_d, with_decode)  # no await in between

    async def _choose(self, f: Features, req: PRequest, exclude: set[int]) -> _Choice:
        ws = [
            w
            for w in self.registry.workers.values()
            if w.role == "prefill" and w.healthy and w.wid not in exclude
        ]
        if not ws:
            raise NoWorker("prefill")
        hits = self.index.hits(f.hashes) if f.hashes else {}
        gblocks = await self.global_tier.hit_blocks(f.hashes, f.tokens) if f.hashes else 0
        shared = self.shared
        # router replicas: the other replicas' figures (None: no Redis, or Redis down)
        t_shared = time.monotonic()
        snap = await shared.refresh() if shared is not None else None
        attempt = 0
        while True:
            view = build_view(
                time.monotonic(),
                ws,
                hits,
                gblocks,
                prompt_tokens=f.prompt_tokens,
                block_size=self.block_size,
                fetch_tokens_per_s=self.fetch_tps,
                sec_per_token=self.cost.c_linear,
                decode=self.decode_cost,
                link_now=self.clock(),
            )
            try:
                d = self.policy.choose(req, view)
            except NoInstanceError:
                raise NoWorker("prefill") from None
            w = self.registry.workers.get(d.instance)
            if w is None or w.wid in exclude:  # a policy returned something odd: be safe
                w = ws[0]
            st = next(s for s in view.instances if s.index == w.wid)
            L = f.prompt_tokens
            own = self.cost.cost(L - st.local_hit, L)
            if snap is not None:
                # book w unless another booking of w won since snap (then choose again on the
                # fresh figures); _book accounts it locally with no await in between
                attempt += 1
                snap = await shared.claim(
                    w, L - st.local_hit, own, snap, attempt, deadline=t_shared + shared.timeout_s
                )
                if snap is not None:
                    continue
            return _Choice(w, d.kind, st, own, view.global_hit, self.policy.feedback(req, st))

    def _book(self, f: Features, req: PRequest, c: _Choice, exclude_d: set[int], with_decode: bool) -> Routed:
        """Synchronous on purpose (see the module docstring): pick the decode worker, then
        account both workers in one call."""
        dw = None
        if with_decode:
            dw = pick_decode(self.registry.role("decode"), exclude_d)
            if dw is None:
                raise NoWorker("decode")
        local = c.state.local_hit
        booking = self.registry.book(c.worker, f.prompt_tokens - local, c.seconds, dw, f.prompt_tokens)
        if c.global_hit > local and self.fetch_tps > 0:
            # the rest of the prefix comes over the worker's link (as the simulator's _route)
            c.worker.fetch_booked(self.clock(), (c.global_hit - local) / self.fetch_tps)
        return Routed(booking, c.kind, local, c.global_hit, req, c.feedback, f.hashes, self)
