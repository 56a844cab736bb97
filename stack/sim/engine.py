"""Discrete-event simulator of a PD-disaggregated prefill cluster: the event loop, routing
(through the router's queue when it holds one) and prefill batching.

Per instance, scheduling follows SGLang's prefill scheduler: a FCFS waiting queue (by
priority class then arrival with the dispatch key ``prio=1``, stack/sim/instance.py); each
forward pass takes the unfinished chunked request first, then waiting requests in order,
up to a token budget (``--chunked-prefill-size``); a request larger than what is left of
the budget is chunked and continues in the next forward. A forward costs
``c_fwd + sum(c_linear*n + c_attn*n*(end - n/2) + c_prefix*(end - n)^2/2)`` over its chunks. A request whose
global-tier fetch is still in flight is skipped until its KV has arrived.

Tiers: a local HBM prefix cache per instance (LRU, capacity in tokens) and an optional
global tier (LRU with a capacity, or unbounded) whose fetches go over a link shared by the
instances of a server (or one link per GPU), FIFO at the link's bandwidth. KV is written
to both tiers when a request's prefill completes.

Router view: exact and causal: queued work, running requests and the cache contents at
the moment of the decision (what KV events would have told a live router); see
stack/sim/view.py.

The mode (``SimConfig.mode``) is a scheduler the engine is composed with
(stack/sim/scheduler.py): under PD disaggregation (:class:`~stack.sim.scheduler.PDScheduler`)
decode is not simulated (a separate pool): a request is answered ``output_len * tpot`` after
its prefill, and the agent's next turn arrives ``think`` seconds later. PD colocation
(prefill chunks and decodes in the same forwards, TPOT per request) is
:class:`~stack.sim.colocated.ColocatedScheduler`. The rest of the package: the config and
result types (config.py), instance, job and link state (instance.py), the event kinds
(events.py), the metrics of a run (metrics.py).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from typing import Any

from stack.core.cost_model import CostModel
from stack.core.types import ClusterView, DecisionKind, InstanceState, Request
from stack.dispatch import Dispatcher, Entry, Rejected, estimate_size
from stack.dispatch.bypass import unbind_at_release
from stack.dispatch.sglang_priority import priority_class
from stack.kv_tier.prefix_cache import PrefixCache
from stack.policies import Policy, PolicyContext, make_policy
from stack.sim import clients as cl
from stack.sim import metrics
from stack.sim.colocated import ColocatedScheduler
from stack.sim.config import GlobalTierSpec, SimConfig, SimResult
from stack.sim.events import ARRIVE, CLIENT_TIMEOUT, FORWARD_DONE, QUEUE_TIMER, WAKE, WRITTEN
from stack.sim.instance import Instance, Job, Link, enqueue_by_class, window_overlap
from stack.sim.load import LoadSpec, SessionStart, plan, resolve_load_mode
from stack.sim.scheduler import PDScheduler, Scheduler
from stack.sim.sessions import SessionClock
from stack.sim.view import build_view
from stack.traces.model import Trace, TraceRequest

#: the scheduler of each ``SimConfig.mode``
SCHEDULERS: dict[str, Callable[[Simulator], Scheduler[Any]]] = {
    "pd": PDScheduler,
    "colocated": ColocatedScheduler,
}


class Simulator:
    """One simulated run of ``trace`` under ``policy`` (a name or a built policy) on the
    cluster ``config`` describes, loaded as ``load`` says; :meth:`run` returns its result."""

    def __init__(
        self,
        trace: Trace,
        policy: str | Policy,
        config: SimConfig | None = None,
        load: LoadSpec | None = None,
    ) -> None:
        self.trace = trace
        self.cfg = config or SimConfig()
        self.cfg.validate()
        self.load = load or LoadSpec(mode=resolve_load_mode(trace))
        hw = self.cfg.hardware
        self.cost: CostModel = hw.cost
        self.bs = trace.block_size
        self.chunk = self.cfg.chunk_tokens or hw.chunk_tokens
        ctx = PolicyContext(
            cost=self.cost,
            slo=self.cfg.slo,
            block_size=self.bs,
            colocated=self.cfg.mode == "colocated",
            chunk_tokens=self.chunk,
        )
        self.policy = (
            make_policy(policy, ctx, **self.cfg.policy_params) if isinstance(policy, str) else policy
        )
        hbm = self.cfg.hbm_tokens if self.cfg.hbm_tokens is not None else hw.hbm_kv_tokens
        cap_blocks = hbm // self.bs
        bw = hw.link_tokens_per_s(self.cfg.link == "shared")
        n = self.cfg.instances
        self.at_schedule = self.cfg.match_at == "schedule"
        self.write_link = self.cfg.global_write == "link"
        # the mode: how instances run their work (prefill only, or prefill and decode)
        sched = SCHEDULERS[self.cfg.mode](self)
        self.scheduler = sched
        # its hooks, bound once: the event loop and batching call them per event and request
        self._schedule = sched.schedule
        self._forward_done = sched.forward_done
        self._fits = sched.fits
        self._admit = sched.admit
        self._first_token = sched.first_token
        lk = self.at_schedule
        if self.cfg.link == "shared":
            per = max(1, hw.gpus_per_server)
            links = [Link(bw) for _ in range((n + per - 1) // per)]
            self.insts: list[Instance] = [
                sched.new_instance(i, cap_blocks, links[i // per], lk) for i in range(n)
            ]
        else:
            self.insts = [sched.new_instance(i, cap_blocks, Link(bw), lk) for i in range(n)]
        # a transfer, once at the head of its link's FIFO, gets the link's full bandwidth;
        # sharing shows up as backlog (InstanceState.fetch_backlog_s)
        self.fetch_bw_est = bw
        self.links = list({id(i.link): i.link for i in self.insts}.values())
        gt = self.cfg.global_tier
        if gt.mode == "none":
            self.glob: PrefixCache | None = None
        else:
            cap = None if gt.mode == "full" else (gt.capacity_tokens or 0) // self.bs
            self.glob = PrefixCache(cap)
        self.fetch_tokens_per_s = self.fetch_bw_est if self.glob is not None else 0.0
        # one view, refreshed in place for every request (build_view)
        self.view = ClusterView(
            now=0.0,
            instances=[InstanceState(i) for i in range(n)],
            block_size=self.bs,
            fetch_tokens_per_s=self.fetch_tokens_per_s,
        )
        # a session id costs a string per request: only for the policies that read it
        self.needs_session_id = self.policy.needs_session_id
        # successors in each agent stream, and first turns of each stream per session
        reqs = trace.requests
        self.next_in_stream = [-1] * len(reqs)
        self.stream_heads: list[list[int]] = [[] for _ in trace.sessions]
        for r in reqs:
            if r.prev >= 0:
                self.next_in_stream[r.prev] = r.idx
            else:
                self.stream_heads[r.session].append(r.idx)
        self._heap: list = []
        self._seq = 0
        # dispatch: with ``immediate`` every request is routed at its arrival, as before
        # several router replicas: one queue each (requests spread over them round-robin,
        # as a load balancer in front of the replicas would), all over the same instances;
        # how they share the queue is ``replica_mode`` (docs/dispatch.md, "Router replicas")
        spec = self.cfg.dispatch
        self.replica_mode = (spec.replica_mode or "own") if spec.replicas > 1 else "own"
        self.disps = [spec.build() for _ in range(spec.replicas)]
        self.disp = self.disps[0]
        self.late = not self.disp.immediate
        # clients that time out and retry (stack/sim/clients.py), or None
        self.clients = self.cfg.clients
        self.client_rng = random.Random(self.load.seed)
        # ``bypass``: link-bound requests dispatched at arrival (stack/dispatch/bypass.py);
        # None (off, and always without a global tier): every request is queued
        self.bypass = self.disp.bypass if self.glob is not None else None
        self.n_bypassed = 0
        # ``affinity``: a released request not held to the ready instances where that would
        # make it link-bound (stack/dispatch/bypass.py, unbind_at_release)
        self.affinity = self.disp.affinity if self.glob is not None else None
        self.n_unbound = 0
        # ``prio=1``: instances compute by priority class (SGLang's priority scheduling)
        self.prio = spec.sglang_priority
        # the instances' load as the dispatcher reads it (refreshed before each release)
        self.loads = [InstanceState(i) for i in range(n)]
        self.timer_at = math.inf
        self.depth_max = 0
        # headroom accounting (stack/sim/headroom.py): a list to collect one record per
        # measured request, or None (the default: nothing recorded, nothing computed)
        self.hr: list[tuple] | None = None
        self.hr_qmin: dict[int, float] = {}

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def _acc(self, inst: Instance, t: float) -> None:
        """Integrate the instance's queue length over time into fixed windows."""
        lt = inst.last_t
        n = inst.n_jobs
        if n and t > lt:
            W = self.cfg.window_s
            w0 = int(lt // W)
            w1 = int(t // W)
            area = inst.area
            if w0 == w1:
                area[w0] = area.get(w0, 0.0) + n * (t - lt)
            else:
                area[w0] = area.get(w0, 0.0) + n * ((w0 + 1) * W - lt)
                for w in range(w0 + 1, w1):
                    area[w] = area.get(w, 0.0) + n * W
                area[w1] = area.get(w1, 0.0) + n * (t - w1 * W)
        inst.last_t = t

    # ------------------------------------------------------------------ main loop
    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        wall0 = time.perf_counter()
        starts, self.w_start, self.w_end = plan(self.trace, self.load)
        # sessions mode: no arrival after the run's end; compress mode replays every request
        # of the trace (a follow-up delayed past the recorded end is still sent and measured)
        self.horizon = self.w_end if self.load.mode == "sessions" else math.inf
        self.last_arrival = 0.0
        self.mode = self.load.mode
        for lk in self.links:
            lk.ws, lk.we = self.w_start, self.w_end
        for s in starts:
            self._start_session(s)
        self.sessions = SessionClock(self.trace, self.cost, self.w_start, self.w_end)
        # metrics accumulators
        self.n_issued = 0
        self.n_done = 0
        self.m = {
            "requests": 0, "met": 0, "prompt": 0, "prompt_met": 0, "local": 0, "global": 0,
            "computed": 0, "sticks": 0, "migrations": 0, "first_turns": 0, "balance": 0,
            "fetch_tokens": 0, "fetch_wait_s": 0.0, "fetch_requests": 0, "evicted_followups": 0,
            "rematch_short": 0, "rematch_short_tokens": 0, "over_2x": 0, "over_5x": 0,
            "rejected": 0, "attempts": 0, "refusals": 0, "timeouts": 0, "failed": 0,
            "abandoned_served": 0,
        }  # fmt: skip
        self.n_rejected = 0
        self.n_cancelled = 0  # attempts the router took back when their client gave up
        #: the longest wait of a request the queue's bound refused (it left the queue then)
        self.rejected_wait_max = 0.0
        self.ttfts: list[float] = []
        self.qwaits: list[float] = []
        heap = self._heap
        pop = heapq.heappop
        next_report = 0.0
        while heap:
            t, _, kind, obj = pop(heap)
            if kind == ARRIVE:
                self._arrive(t, obj)
            elif kind == FORWARD_DONE:
                self._forward_done(t, obj)
            elif kind == WRITTEN:
                self.glob.insert(obj)  # type: ignore[union-attr]
            elif kind == QUEUE_TIMER:
                if self.timer_at <= t:
                    self.timer_at = math.inf
                self._pump(t)
            elif kind == CLIENT_TIMEOUT:
                self._client_timeout(t, obj)
            else:
                inst = obj
                if inst.wake_at <= t:
                    inst.wake_at = math.inf
                    self._schedule(inst, t)
            if progress is not None and t >= next_report:
                progress(min(t, self.w_end))
                next_report = t + (self.w_end if math.isfinite(self.w_end) else 3600.0) / 200.0
        self.end_time = max((i.last_t for i in self.insts), default=0.0)
        uspan, imb = self._close()
        res = metrics.result(self, time.perf_counter() - wall0, uspan, imb)
        self.scheduler.finish(res)
        return res

    def _start_session(self, s: SessionStart) -> None:
        for ridx in self.stream_heads[s.session]:
            tr = self.trace.requests[ridx]
            t = s.start + tr.offset / s.time_scale
            if t < self.horizon:
                self.push(t, ARRIVE, (tr, s))

    # ------------------------------------------------------------------ routing
    def _arrive(self, now: float, item) -> None:
        tr: TraceRequest
        tr, sess = item[0], item[1]
        att = None
        if self.clients is not None:
            # a retry carries its attempt; a first attempt starts one
            att = item[2] if len(item) > 2 else cl.Attempt(1, now, now)
            if self.w_start <= att.first <= self.w_end:
                self.m["attempts"] += 1
            self.push(now + self.clients.patience_s, CLIENT_TIMEOUT, att)
        self.n_issued += 1
        self.last_arrival = now
        L = tr.input_len
        off = sess.replica * self.trace.n_owners
        if off:
            path = self._private(tr.path, off)
        else:
            path = tr.path
        prev_len = 0
        if tr.prev >= 0:
            p = self.trace.requests[tr.prev]
            prev_len = p.input_len + p.output_len
        req = Request(
            prompt_tokens=L,
            turn=tr.turn,
            est_hit=min(prev_len, L),
            session_id=str(sess.copy) if self.needs_session_id else None,
            output_tokens=tr.output_len,
        )
        if not self.late:
            self._route(now, tr, sess, path, req, now, None, att)
            return
        if self.bypass is not None and self._bypass_now(now, path, L):
            self.n_bypassed += 1
            self._replica_of(sess).bypassed(self.cfg.slo.ttft(L))
            self._route(now, tr, sess, path, req, now, None, att)
            return
        # the prompt's fingerprint, as the live router's: its length and last block
        key = (L, path[-1]) if path else None
        e = Entry(
            (tr, sess, path, att), req, now, self.cfg.slo.ttft(L), estimate_size(self.cost, req), key=key
        )
        disp = self._replica_of(sess)
        if att is not None:
            att.entry = e
            att.disp = disp
        r = disp.admit(e, now)
        depth = self._depth()
        if depth > self.depth_max:
            self.depth_max = depth
        if r is not None:
            self._reject(now, r)
        self._pump(now)

    def _bypass_now(self, now: float, path, L: int) -> bool:
        """Whether the dispatcher's bypass rule dispatches this request at once: its
        global-tier fetch beyond the best local hit, behind the least link backlog, takes
        longer than its compute (:meth:`stack.dispatch.bypass.Bypass.on_view`)."""
        if not path:
            return False
        view = build_view(now, self.insts, path, L, self.bs, self.glob, self.fetch_tokens_per_s, self.view)
        return self.bypass.on_view(view, L, self.cost)

    def _unbind_now(self, view, mask: list[bool], L: int) -> bool:
        """Whether the dispatcher's affinity rule routes a request released to the ``mask``
        instances over every instance instead (:func:`stack.dispatch.bypass.unbind_at_release`)."""
        return unbind_at_release(self.affinity, view, mask, L, self.cost)

    def _replica_of(self, sess: SessionStart) -> Dispatcher:
        """The replica whose queue holds an arriving request: round-robin (``own``,
        ``claims``: a load balancer in front of the replicas), the leader's (``leader``: the
        replica that took it forwards it), or by its session (``hash``)."""
        disps = self.disps
        n = len(disps)
        if n == 1 or self.replica_mode == "leader":
            return disps[0]
        if self.replica_mode == "hash":
            return disps[(sess.copy * 2654435761 & 0xFFFFFFFF) % n]
        return disps[self.n_issued % n]

    def _route(
        self,
        now: float,
        tr: TraceRequest,
        sess,
        path,
        req: Request,
        arrival: float,
        mask: list[bool] | None,
        att: cl.Attempt | None = None,
    ) -> Instance:
        """Ask the policy where ``req`` goes (among the instances ``mask`` marks, all if
        ``None``) and queue it there; ``arrival`` is when the request came in (``att``: its
        client's attempt, whose first attempt TTFT counts from)."""
        L = tr.input_len
        bs = self.bs
        view = build_view(now, self.insts, path, L, bs, self.glob, self.fetch_tokens_per_s, self.view)
        views = view.instances
        g = view.global_hit
        if mask is not None:
            if self.affinity is not None and self._unbind_now(view, mask, L):
                self.n_unbound += 1
                mask = None  # routed over every instance (stack/dispatch/bypass.py)
            else:
                for v, ok in zip(views, mask):
                    v.healthy = ok
        d = self.policy.choose(req, view)
        inst = self.insts[d.instance]
        c = views[d.instance].local_hit
        job = Job()
        job.tr = tr
        job.copy = sess
        job.path = path
        job.L = L
        job.qwait = now - arrival
        job.att = att
        if att is not None:
            arrival = att.first
            att.job = job
            att.inst = inst
        job.arrival = arrival
        job.kind = d.kind
        job.req = req
        job.measured = self.w_start <= arrival <= self.w_end
        job.feat = self.policy.feedback(req, views[d.instance])
        if self.hr is not None:
            # the least queued work on any instance as this request is placed (imbalance)
            self.hr_qmin[id(job)] = min(v.queued_seconds for v in views)
        if mask is not None:
            for v in views:
                v.healthy = True
        job.matched = not self.at_schedule
        job.held = None
        job.out = tr.output_len
        job.admitted = False
        if c and path and job.matched:
            inst.cache.touch(path, c // bs + 1)
        job.local = c
        job.glob = 0
        job.fetched = 0
        job.fwait = 0.0
        job.ready_at = now
        if g > c:
            # the rest of the prefix comes from the global tier over this instance's link
            job.glob = job.fetched = g - c
            job.ready_at = inst.link.fetch(now, g - c)
            job.fwait = job.ready_at - now
        new = L - c - job.glob
        job.rem = new
        job.pos = L - new
        job.est = self.cost.cost(new, L)
        self._acc(inst, now)
        inst.n_jobs += 1
        inst.a_tokens += L
        inst.q_tokens += new
        inst.q_seconds += job.est
        if self.prio:
            slo = self.cfg.slo
            enqueue_by_class(inst.waiting, job, priority_class(slo.ttft(L) - job.qwait, slo))
        else:
            inst.waiting.append(job)
        self._schedule(inst, now)
        return inst

    # ------------------------------------------------------------------ dispatch
    def _load(self, inst: Instance, now: float) -> None:
        s = self.loads[inst.idx]
        s.queued_seconds = inst.q_seconds
        s.running = inst.n_jobs
        fb = inst.link.free_at - now
        s.fetch_backlog_s = fb if fb > 0 else 0.0

    def _pump(self, now: float) -> None:
        """Run the dispatcher's cycle: reject what waited too long, release entries while
        an instance is ready (the policy choosing among the ready ones), set the timer."""
        disps = self.disps
        for disp in disps:
            for r in disp.expire(now):
                self._reject(now, r)
            for e in disp.take_overdue():  # a retry at its bound: routed at once, everywhere
                tr, sess, path, att = e.handle
                self._route(now, tr, sess, path, e.request, e.arrival, None, att)
        if not self._depth():
            return
        loads = self.loads
        for inst in self.insts:
            self._load(inst, now)
        if self.replica_mode == "claims":
            self._release_by_rank(now)
        # replicas take turns, one release each (one replica: release while ready)
        more = self.replica_mode != "claims"
        while more:
            more = False
            for disp in disps:
                e = disp.pop(now, loads)
                if e is None:
                    continue
                more = True
                tr, sess, path, att = e.handle
                inst = self._route(now, tr, sess, path, e.request, e.arrival, disp.ready_mask(loads), att)
                self._load(inst, now)
        t = min(disp.next_timer(now, loads) for disp in disps)
        if t < self.timer_at:
            self.timer_at = t
            self.push(t, QUEUE_TIMER, None)

    def _release_by_rank(self, now: float) -> None:
        """``replica_mode=claims``: while an instance is ready, the replica whose next release
        ranks first cluster-wide (:meth:`Dispatcher.head_key`) claims it and releases."""
        loads = self.loads
        while True:
            best = None
            key = None
            for disp in self.disps:
                k = disp.head_key(now, loads)
                if k is not None and (key is None or k < key):
                    best, key = disp, k
            if best is None:
                return
            e = best.pop(now, loads)
            if e is None:
                return
            tr, sess, path, att = e.handle
            inst = self._route(now, tr, sess, path, e.request, e.arrival, best.ready_mask(loads), att)
            self._load(inst, now)

    def _depth(self) -> int:
        return sum(d.counters.depth for d in self.disps)

    def _reject(self, now: float, r: Rejected) -> None:
        """An explicit overload answer (a live router's 503 / 529): the attempt is not
        served. Without a client model its agent stream ends there; with one, the client
        retries after the answer's Retry-After while it has retries left."""
        self.n_rejected += 1
        if r.waited_s > self.rejected_wait_max:
            self.rejected_wait_max = r.waited_s
        tr, sess, _, att = r.entry.handle
        if att is None:
            if self.w_start <= r.entry.arrival <= self.w_end:
                self.m["rejected"] += 1
            self.sessions.failed_turn(sess.copy, sess.start, tr.session)
            return
        att.state = cl.REFUSED
        measured = self.w_start <= att.first <= self.w_end
        if measured:
            self.m["refusals"] += 1
        # Retry-After: the refusing queue's drain estimate, the router's rule
        wait = att.disp.retry_after(len(self.insts))
        self._retry_or_fail(now, r.entry.handle, wait, measured, refused=True)

    def _retry_or_fail(
        self, now: float, handle, retry_after: float | None, measured: bool, refused: bool
    ) -> None:
        """The client of the attempt in ``handle`` retries (a new arrival, after its delay)
        while it has retries left; else its request failed and its agent stream ends."""
        tr, sess, _, att = handle
        cm = self.clients
        if att.n <= cm.max_retries:
            at = now + cm.delay(att.n, retry_after, self.client_rng)
            if at < self.horizon or self.mode == "compress":
                self.push(at, ARRIVE, (tr, sess, att.retry(at)))
                return
        if measured:
            self.m["rejected" if refused else "failed"] += 1
        self.sessions.failed_turn(sess.copy, sess.start, tr.session)

    def _client_timeout(self, now: float, att: cl.Attempt) -> None:
        """A client's patience with ``att`` ran out: if it has no first token yet, the client
        abandons it (the router takes it back: out of its queue, or off its instance while it
        waits there; a chunked prefill under way stops at its next chunk boundary,
        :meth:`_abort_started`; PD mode) and retries or fails."""
        if att.state != cl.LIVE:
            return
        att.state = cl.ABANDONED
        measured = self.w_start <= att.first <= self.w_end
        if measured:
            self.m["timeouts"] += 1
        e = att.entry
        if att.job is None and e is not None:
            for d in self.disps:
                if d.cancel(e):
                    self.n_cancelled += 1
                    break
            handle = e.handle
        else:
            j = att.job
            if self.cfg.mode == "pd" and j in att.inst.waiting:
                self._take_back(now, att.inst, j)
            handle = (j.tr, j.copy, j.path, att)
        self._retry_or_fail(now, handle, None, measured, refused=False)

    def _take_back(self, now: float, inst: Instance, j: Job) -> None:
        """The router cancels ``j``, still waiting on ``inst`` (no token of it computed):
        off the instance, its locks released (a fetch booked for it stays spent)."""
        inst.waiting.remove(j)
        self._unbook(inst, now, j)
        self._schedule(inst, now)

    def _unbook(self, inst: Instance, now: float, j: Job) -> None:
        """Take cancelled ``j``'s share off ``inst``'s figures and release its cache locks."""
        self._acc(inst, now)
        inst.n_jobs -= 1
        inst.a_tokens -= j.L
        inst.q_tokens -= j.rem
        inst.q_seconds -= j.est
        if inst.n_jobs == 0:
            inst.q_seconds = 0.0
        if j.held is not None:
            inst.cache.unlock(j.held)  # type: ignore[attr-defined]
            j.held = None
        self.n_cancelled += 1

    def _abort_started(self, now: float, inst: Instance, j: Job) -> None:
        """``j``'s client gave up during its chunked prefill: the router aborts it, and the
        engine stops it at the chunk boundary (SGLang 0.5.23 drops an aborted chunked request
        before its next chunk; the KV computed so far is freed, not cached)."""
        self._unbook(inst, now, j)
        j.est = 0.0

    def _private(self, path, off: int) -> tuple:
        """Keys of a replayed copy: its own for private blocks, shared ones kept shared."""
        su = self.trace.shared_upto
        out = []
        for o, a, b in path:
            s = su[o]
            if s <= a:
                out.append((o + off, a, b))
            elif s >= b:
                out.append((o, a, b))
            else:
                out.append((o, a, s))
                out.append((o + off, s, b))
        return tuple(out)

    # ------------------------------------------------------------------ instance
    def form_batch(self, inst: Instance, now: float) -> float:
        """Form ``inst``'s next prefill batch (``inst.batch``: (job, tokens) pairs) under the
        chunk budget: the chunked job first, then waiting jobs in order, skipping those whose
        KV is still on its way (a WAKE is set for the earliest when nothing else can run) and
        stopping at the first one the scheduler finds no room for (:meth:`Scheduler.fits`).
        Returns the forward's seconds (meaningless when the batch is empty)."""
        budget = self.chunk
        batch = inst.batch
        batch.clear()
        cost = self.cost
        c_lin, c_attn, c_pre = cost.c_linear, cost.c_attn, 0.5 * cost.c_prefix
        t = cost.c_fwd
        j = inst.chunked
        if j is not None:
            n = j.rem if j.rem < budget else budget
            end = j.pos + n
            t += c_lin * n + c_attn * n * (end - 0.5 * n) + c_pre * (end - n) ** 2
            batch.append((j, n))
            budget -= n
            inst.chunked = None
        if budget > 0 and inst.waiting:
            waiting = inst.waiting
            keep: list[Job] = []
            earliest = math.inf
            fits = self._fits
            for k, j in enumerate(waiting):
                if budget <= 0:
                    keep.extend(waiting[k:])
                    break
                if j.ready_at > now:
                    keep.append(j)
                    if j.ready_at < earliest:
                        earliest = j.ready_at
                    continue
                if not j.admitted and not fits(inst, j):
                    keep.extend(waiting[k:])  # it (and the queue behind it) waits for room
                    break
                if not j.matched:
                    self._match(inst, j, now)
                    if j.ready_at > now:
                        keep.append(j)
                        if j.ready_at < earliest:
                            earliest = j.ready_at
                        continue
                if not j.admitted:
                    self._admit(inst, j)
                n = j.rem if j.rem < budget else budget
                end = j.pos + n
                t += c_lin * n + c_attn * n * (end - 0.5 * n) + c_pre * (end - n) ** 2
                batch.append((j, n))
                budget -= n
            inst.waiting = keep
            if not batch and earliest < inst.wake_at:
                inst.wake_at = earliest
                self.push(earliest, WAKE, inst)
        return t

    def _match(self, inst: Instance, j: Job, now: float) -> None:
        """``match_at=schedule``: the instance matches its prefix cache as the job first
        enters a batch and locks what it matched until the job completes. A shortfall
        against the arrival-time hit is fetched from the global tier if it holds it (the
        job then waits for the transfer), otherwise computed; a gain is reused."""
        j.matched = True
        path = j.path
        if not path:
            return
        bs = self.bs
        L = j.L
        cap = L - 1 if L > 0 else 0
        cache = inst.cache
        c2 = cache.hit(path) * bs
        if c2 > cap:
            c2 = cap
        if c2:
            up = -(-c2 // bs)
            cache.touch(path, up)
            j.held = cache.lock(path, up)  # type: ignore[attr-defined]
        c = j.local
        if c2 == c:
            return
        rem0 = j.rem
        if c2 < c:
            f = 0
            if self.glob is not None:
                gs = self.glob.hit(path) * bs
                top = c if gs > c else gs
                if top > c2:
                    f = top - c2
            j.local = c2
            if f:
                j.glob += f
                j.fetched += f
                j.ready_at = inst.link.fetch(now, f)
                j.fwait += j.ready_at - now
            if j.measured:
                self.m["rematch_short"] += 1
                self.m["rematch_short_tokens"] += c - c2
            j.rem += c - c2 - f
        else:
            d = c2 - c
            j.local = c2
            take = d if d < j.glob else j.glob
            j.glob -= take
            j.rem -= d - take
        j.pos = L - j.rem
        if j.rem != rem0:
            inst.q_tokens += j.rem - rem0
            est = self.cost.cost(j.rem, L)
            inst.q_seconds += est - j.est
            j.est = est

    def release_queued(self, now: float) -> None:
        """Work left an instance: release queued requests before it picks its next batch."""
        if self.late and self._depth():
            self._pump(now)

    def apply_batch(self, now: float, inst: Instance) -> None:
        """The forward of ``inst.batch`` ended: each job's tokens are computed; a job with
        more left is the next chunked one, a finished one's first token is out (its caches
        and metrics, then the scheduler's :meth:`Scheduler.first_token`)."""
        cost = self.cost
        for j, n in inst.batch:
            j.rem -= n
            j.pos += n
            inst.q_tokens -= n
            inst.computed += n
            if j.rem > 0:
                if j.att is not None and j.att.state == cl.ABANDONED and self.cfg.mode == "pd":
                    self._abort_started(now, inst, j)
                    continue
                est = cost.cost(j.rem, j.L)
                inst.q_seconds += est - j.est
                j.est = est
                inst.chunked = j
            else:
                inst.q_seconds -= j.est
                j.est = 0.0
                self._prefill_done(now, inst, j)
                self._first_token(now, inst, j)
        inst.batch.clear()
        if inst.n_jobs == 0:
            inst.q_seconds = 0.0  # drop float drift

    def _prefill_done(self, now: float, inst: Instance, j: Job) -> None:
        """``j``'s prefill completed at ``now`` (its first token): caches, TTFT metrics."""
        self._acc(inst, now)
        inst.n_jobs -= 1
        inst.a_tokens -= j.L
        self.n_done += 1
        path = j.path
        if path:
            cache = inst.cache
            cache.insert(path)
            if j.held is not None:
                cache.unlock(j.held)  # type: ignore[attr-defined]
                j.held = None
            glob = self.glob
            if glob is not None:
                if self.write_link:
                    # the new KV is written over this instance's link, visible when done
                    new = j.L - glob.hit(path) * self.bs
                    if new > 0:
                        self.push(inst.link.write(now, new), WRITTEN, path)
                    else:
                        glob.insert(path)
                else:
                    glob.insert(path)
        ttft = now - j.arrival
        if j.feat is not None:
            self.policy.observe(j.req, inst.idx, j.feat, ttft)
        att = j.att
        if att is not None:
            if att.state != cl.LIVE:  # its client gave up on it: the answer reaches nobody
                if j.measured:
                    self.m["abandoned_served"] += 1
                if self.hr is not None:
                    self.hr_qmin.pop(id(j), None)
                return
            att.state = cl.ANSWERED
        sess = j.copy
        self.sessions.first_token(sess.copy, sess.start, j.tr, ttft)
        if j.measured:
            m = self.m
            L = j.L
            m["requests"] += 1
            m["prompt"] += L
            m["local"] += j.local
            m["global"] += j.glob
            m["computed"] += L - j.local - j.glob
            if j.fetched:
                m["fetch_tokens"] += j.fetched
                m["fetch_wait_s"] += j.fwait
                m["fetch_requests"] += 1
            slo = self.cfg.slo.ttft(L)
            if ttft <= slo:
                m["met"] += 1
                m["prompt_met"] += L
            elif ttft > 2.0 * slo:
                m["over_2x"] += 1
                if ttft > 5.0 * slo:
                    m["over_5x"] += 1
            k = j.kind
            if k is DecisionKind.STICK:
                m["sticks"] += 1
            elif k is DecisionKind.MIGRATE:
                m["migrations"] += 1
            elif k is DecisionKind.FIRST_TURN:
                # a follow-up balanced as if new (SMetric: its session was evicted locally)
                if j.req.turn > 1:
                    m["evicted_followups"] += 1
                else:
                    m["first_turns"] += 1
            else:
                m["balance"] += 1
            self.ttfts.append(ttft)
            self.qwaits.append(j.qwait)
            if self.hr is not None:
                self.hr.append(
                    (j.tr.idx, j.arrival, j.qwait, j.fwait, j.fetched, L - j.local - j.glob, L,
                     ttft, self.hr_qmin.pop(id(j), 0.0))
                )  # fmt: skip
        elif self.hr is not None:
            self.hr_qmin.pop(id(j), None)

    def answered(self, j: Job, answered: float) -> None:
        """``j``'s answer is complete at ``answered``: its agent stream's next turn follows
        (not after an answer its client gave up on: the retry's answer carries the stream)."""
        if j.att is not None and j.att.state != cl.ANSWERED:
            return
        tr = j.tr
        self.sessions.answered(j.copy.copy, tr, answered)
        nxt = self.next_in_stream[tr.idx]
        if nxt >= 0:
            ntr = self.trace.requests[nxt]
            sess = j.copy
            if self.mode == "compress":
                t = max(sess.start + ntr.offset / sess.time_scale, answered)
            else:
                t = answered + self.load.think(ntr.think, sess.copy, nxt)
            if t < self.horizon:
                self.push(t, ARRIVE, (ntr, sess))

    # ------------------------------------------------------------------ results
    def _close(self) -> tuple[float, list[float]]:
        """The run is over: close an open measurement window, integrate the instances' load
        to the end and check that no request was lost. Returns the seconds utilization is
        over and the per-window imbalance."""
        # busy time was counted up to the window's end; an open window (compress mode
        # measuring every request) ends at the end of the run for utilization
        uspan = max(min(self.w_end, self.end_time) - self.w_start, 1e-9)
        if math.isinf(self.w_end):
            self.w_end = max(self.last_arrival, self.w_start)
        for inst in self.insts:
            self._acc(inst, self.end_time)
        imb = metrics.imbalance(self.insts, self.cfg.window_s, self.w_start, self.w_end)
        if self._depth() or self.n_issued != self.n_done + self.n_rejected + self.n_cancelled:
            # conservation: every admitted attempt is served once, rejected explicitly, or
            # taken back when its client gave up
            raise RuntimeError(
                f"dispatch lost requests: issued {self.n_issued}, served {self.n_done}, "
                f"rejected {self.n_rejected}, cancelled {self.n_cancelled}, still queued {self._depth()}"
            )
        return uspan, imb


def make_simulator(
    trace: Trace, policy: str | Policy, config: SimConfig | None = None, load: LoadSpec | None = None
) -> Simulator:
    """The simulator for ``config.mode`` (the engine picks its scheduler by mode)."""
    return Simulator(trace, policy, config, load)


def simulate(
    trace: Trace, policy: str, config: SimConfig | None = None, load: LoadSpec | None = None
) -> dict:
    """Convenience: run one simulation and return its metrics."""
    return Simulator(trace, policy, config, load).run().metrics


__all__ = [
    "SCHEDULERS",
    "GlobalTierSpec",
    "SimConfig",
    "SimResult",
    "Simulator",
    "make_simulator",
    "simulate",
    "window_overlap",
]
