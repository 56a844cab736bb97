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

Routing owns the view: every :class:`ClusterView` of the live router is built here
(:meth:`PrefillRouter.view` for a request, :meth:`PrefillRouter.load_states` for the dispatch
queue's readiness, which has no request), and the dispatch queue asks routing, not the index,
whether a link rule holds (:meth:`PrefillRouter.bypasses`, :meth:`PrefillRouter.unbinds`).
What the cluster holds of a request's prefix is a :class:`Lookup`, taken once per request (the
prefix index at once, the global tier the first time a step needs it) and carried from the
queue's admission to the routing step, so a queued request asks each of them at most once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stack.core.cost_model import CostModel, DecodeCost
from stack.core.types import ClusterView, DecisionKind, InstanceState, usable_hit
from stack.core.types import Request as PRequest
from stack.decode_router.decode_choice import pick_decode
from stack.dispatch.bypass import Bypass, unbind_at_release
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
class Lookup:
    """What the cluster holds of one request's prefix (see the module docstring): the prefix
    index's hits by worker id, in blocks (absent: 0), and the global tier's hit in blocks
    (None until a step asks: :meth:`PrefillRouter.global_blocks`)."""

    hits: Mapping[int, int] = field(default_factory=dict)
    global_blocks: int | None = None


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
        time_factor: float = 1.0,
    ) -> None:
        """``decode_cost``: PD colocation (the prefill workers decode too): the view carries
        each worker's running decodes priced with it (:func:`build_view`); None under PD.
        ``clock``: the pool's clock (router.time_factor), on which each worker's link backlog
        is kept: a booked request that fetches part of its prefix from the global tier queues
        that fetch on its worker's link (:meth:`Worker.fetch_booked`), and the view carries
        the backlog (``fetch_backlog_s``). ``time_factor``: wall seconds per second of the
        pool (router.time_factor), for what a worker has computed (:meth:`load_states`)."""
        self.clock = clock
        self.time_factor = time_factor
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

    # ------------------------------------------------------------------ the cluster's figures
    def lookup(self, f: Features) -> Lookup:
        """The prefix index's hits of ``f`` (the global tier's are asked later, once)."""
        return Lookup(self.index.hits(f.hashes) if f.hashes else {})

    async def global_blocks(self, f: Features, lk: Lookup) -> int:
        """The global tier's hit of ``f`` in blocks: asked the first time, then ``lk``'s."""
        if lk.global_blocks is None:
            lk.global_blocks = await self.global_tier.hit_blocks(f.hashes, f.tokens) if f.hashes else 0
        return lk.global_blocks

    def candidates(self, exclude: set[int] | frozenset[int] = frozenset()) -> list[Worker]:
        """The healthy prefill workers not in ``exclude`` nor draining, in the registry's order."""
        return [
            w
            for w in self.registry.workers.values()
            if w.role == "prefill" and w.healthy and w.draining_until is None and w.wid not in exclude
        ]

    def view(self, ws: list[Worker], lk: Lookup, global_blocks: int, prompt_tokens: int) -> ClusterView:
        """The policy's view of a request of ``prompt_tokens`` over ``ws`` (the one place the
        live router builds a request's view: :func:`~stack.prefill_router.view.build_view`)."""
        return build_view(
            time.monotonic(),
            ws,
            lk.hits,
            global_blocks,
            prompt_tokens=prompt_tokens,
            block_size=self.block_size,
            fetch_tokens_per_s=self.fetch_tps,
            sec_per_token=self.cost.c_linear,
            decode=self.decode_cost,
            link_now=self.clock(),
        )

    def load_states(self, now: float, ws: list[Worker]) -> list[InstanceState]:
        """The workers as the dispatch queue's readiness sees them (no request: no hits), at
        ``now`` on the pool's clock: the view's figures, except that a worker's queued seconds
        leave out what it has computed (:meth:`Worker.computed_seconds`), as the simulator's
        instances count their remaining work, not the requests whose answer has not returned
        yet; each worker's link backlog is the fetches booked on it (:meth:`Worker.link_backlog`)."""
        v = build_view(
            now,
            ws,
            {},
            0,
            prompt_tokens=0,
            block_size=self.block_size,
            fetch_tokens_per_s=self.fetch_tps,
            sec_per_token=self.cost.c_linear,
            decode=self.decode_cost,
            link_now=now,
        )
        wall = time.monotonic()
        for s, w in zip(v.instances, ws, strict=True):
            done = w.computed_seconds(wall, self.time_factor)
            if done > 0.0:
                s.queued_seconds = s.queued_seconds - done if s.queued_seconds > done else 0.0
        return v.instances

    # ------------------------------------------------------------------ the link rules
    async def bypasses(self, f: Features, lk: Lookup, rule: Bypass, exclude: set[int]) -> bool:
        """The bypass rule at admission (:mod:`stack.dispatch.bypass`): whether ``f``'s fetch
        from the global tier makes it link-bound on every candidate worker, so it is dispatched
        at once rather than queued. Never without hashes or fetch bandwidth."""
        got = await self._link_view(f, lk, rule, exclude, frozenset())
        return got is not None and rule.on_view(got[0], f.prompt_tokens, self.cost)

    async def unbinds(
        self, f: Features, lk: Lookup, rule: Bypass, exclude: set[int], not_ready: frozenset[int]
    ) -> bool:
        """The affinity rule at ``f``'s release (``not_ready``: the workers the ready mask left
        out): whether it routes over every worker instead of the ready ones
        (:func:`~stack.dispatch.bypass.unbind_at_release`, the simulator's test)."""
        got = await self._link_view(f, lk, rule, exclude, not_ready)
        if got is None:
            return False
        v, ws = got
        ready = [w.wid not in not_ready for w in ws]
        return unbind_at_release(rule, v, ready, f.prompt_tokens, self.cost)

    async def _link_view(
        self, f: Features, lk: Lookup, rule: Bypass, exclude: set[int], not_ready: frozenset[int]
    ) -> tuple[ClusterView, list[Worker]] | None:
        """``f``'s view over the candidate workers, for a link rule: None where the rule cannot
        hold (no hashes, no fetch bandwidth, no worker), or where even a global tier holding
        the whole hashed prefix would not make ``f`` link-bound on the workers not in
        ``not_ready`` (the rule grows with the global hit: the global tier is asked only past
        that test), or, with ``not_ready``, where none of those holds more of the prefix than
        the others."""
        if not f.hashes or not self.fetch_tps > 0:
            return None
        ws = self.candidates(exclude)
        if not ws:
            return None  # the routing step answers no_worker
        L = f.prompt_tokens
        bs = self.block_size
        local = [usable_hit(lk.hits.get(w.wid, 0) * bs, L) for w in ws]
        best = max((h for h, w in zip(local, ws) if w.wid not in not_ready), default=0)
        if not_ready and max(local) <= best:
            return None  # no worker left out holds more of the prefix: nothing to unbind
        g_max = usable_hit(len(f.hashes) * bs, L)
        now = self.clock()
        backlog = min((w.link_backlog(now) for w in ws if w.wid not in not_ready), default=0.0)
        if not rule.decide(g_max - best, L - g_max, L, self.fetch_tps, backlog, self.cost):
            return None
        return self.view(ws, lk, await self.global_blocks(f, lk), L), ws

    # ------------------------------------------------------------------ choose, then book
    async def route(
        self,
        f: Features,
        exclude_p: set[int],
        exclude_d: set[int],
        with_decode: bool,
        lk: Lookup | None = None,
    ) -> Routed:
        """Choose and book a prefill worker not in ``exclude_p`` and, ``with_decode``, a
        decode worker not in ``exclude_d``; ``lk``: what an earlier step looked up of ``f``
        (default: looked up now). Raises :class:`NoWorker`."""
        req = self.request_of(f)
        choice = await self._choose(f, req, exclude_p, self.lookup(f) if lk is None else lk)
        return self._book(f, req, choice, exclude_d, with_decode)  # no await in between

    async def _choose(self, f: Features, req: PRequest, exclude: set[int], lk: Lookup) -> _Choice:
        ws = self.candidates(exclude)
        if not ws:
            raise NoWorker("prefill")
        gblocks = await self.global_blocks(f, lk)
        shared = self.shared
        # router replicas: the other replicas' figures (None: no Redis, or Redis down)
        t_shared = time.monotonic()
        snap = await shared.conn.refresh() if shared is not None else None
        attempt = 0
        while True:
            view = self.view(ws, lk, gblocks, f.prompt_tokens)
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
                snap = await shared.bookings.claim(
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
