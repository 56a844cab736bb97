"""Discrete-event simulator of a PD-disaggregated prefill cluster: the event loop and the
routing of each request to an instance.

:class:`Simulator` wires a run together and drives it. Its events (stack/sim/events.py) are
arrivals, forwards that end, global-tier writes that land, the router queue's timers,
clients' patience running out and instances woken when a fetch is in. An arriving request is
routed at once, or through the router's queue when the dispatch order holds one
(:class:`~stack.sim.queues.RouterQueue`); routing asks the policy for an instance over an
exact, causal view of the cluster (queued work, running requests and cache contents at that
moment: what KV events would have told a live router; stack/sim/view.py) and queues the
request there.

The rest lives with its concern. Prefill batching and what a finished prefill leaves
behind: stack/sim/batching.py. Clients that give up and retry: stack/sim/retries.py. The
counts of a run: stack/sim/tally.py, turned into its metrics by stack/sim/metrics.py. The
mode (``SimConfig.mode``) is a scheduler the engine is composed with (stack/sim/scheduler.py):
under PD disaggregation (:class:`~stack.sim.scheduler.PDScheduler`) decode is not simulated
(a separate pool): a request is answered ``output_len * tpot`` after its prefill, and the
agent's next turn arrives ``think`` seconds later. PD colocation (prefill chunks and decodes
in the same forwards, TPOT per request) is :class:`~stack.sim.colocated.ColocatedScheduler`.

Tiers: a local HBM prefix cache per instance (LRU, capacity in tokens) and an optional
global tier (LRU with a capacity, or unbounded) whose fetches go over a link shared by the
instances of a server (or one link per GPU), FIFO at the link's bandwidth. KV is written
to both tiers when a request's prefill completes. The config and result types are in
config.py, instance, job and link state in instance.py.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import Any

from stack.core.cost_model import CostModel
from stack.core.types import ClusterView, InstanceState, Request
from stack.dispatch.sglang_priority import priority_class
from stack.kv_tier.prefix_cache import PrefixCache
from stack.policies import Policy, PolicyContext, make_policy
from stack.sim import clients as cl
from stack.sim import metrics
from stack.sim.batching import Batcher
from stack.sim.colocated import ColocatedScheduler
from stack.sim.config import GlobalTierSpec, SimConfig, SimResult
from stack.sim.events import ARRIVE, CLIENT_TIMEOUT, FORWARD_DONE, QUEUE_TIMER, WRITTEN
from stack.sim.instance import Instance, Job, Link, accrue, enqueue_by_class, window_overlap
from stack.sim.load import LoadSpec, SessionStart, plan, resolve_load_mode
from stack.sim.queues import RouterQueue
from stack.sim.retries import ClientRetries
from stack.sim.scheduler import PDScheduler, Scheduler
from stack.sim.sessions import SessionClock
from stack.sim.tally import Tally
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
        self.window_s = self.cfg.window_s
        # the mode: how instances run their work (prefill only, or prefill and decode)
        sched = SCHEDULERS[self.cfg.mode](self)
        self.scheduler = sched
        # its hooks, bound once: the event loop and routing call them per event and request
        self._schedule = sched.schedule
        self._forward_done = sched.forward_done
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
        self.tally = Tally()
        # the router's queue (stack/sim/queues.py); with ``immediate`` every request is
        # routed at its arrival
        self.queue = RouterQueue(self)
        self.late = self.queue.late
        # clients that time out and retry (stack/sim/clients.py), or None
        self.clients = self.cfg.clients
        self.retries = ClientRetries(self, self.load.seed)
        # ``prio=1``: instances compute by priority class (SGLang's priority scheduling)
        self.prio = self.cfg.dispatch.sglang_priority
        self.batcher = Batcher(self)
        # what the scheduler calls of the engine (stack/sim/scheduler.py, Host)
        self.form_batch = self.batcher.form_batch
        self.apply_batch = self.batcher.apply_batch
        self.hand_over = self.batcher.hand_over
        self.release_queued = self.queue.release_queued
        # headroom accounting (stack/sim/headroom.py): a list to collect one record per
        # measured request, or None (the default: nothing recorded, nothing computed)
        self.hr: list[tuple] | None = None
        self.hr_qmin: dict[int, float] = {}

    def push(self, t: float, kind: int, obj: Any) -> None:
        """Schedule an event of ``kind`` (stack/sim/events.py) carrying ``obj`` at ``t``."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    # ------------------------------------------------------------------ main loop
    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        """Play the run to its end (``progress``: called now and then with the simulated time)."""
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
        self.sessions = SessionClock(
            self.trace, self.cost, self.w_start, self.w_end, getattr(self.scheduler, "handoff_typical", None)
        )
        heap = self._heap
        pop = heapq.heappop
        arrive = self._arrive
        forward_done = self._forward_done
        timer = self.queue.timer
        timeout = self.retries.timeout
        schedule = self._schedule
        next_report = 0.0
        while heap:
            t, _, kind, obj = pop(heap)
            if kind == ARRIVE:
                arrive(t, obj)
            elif kind == FORWARD_DONE:
                forward_done(t, obj)
            elif kind == WRITTEN:
                self.glob.insert(obj)  # type: ignore[union-attr]
            elif kind == QUEUE_TIMER:
                timer(t)
            elif kind == CLIENT_TIMEOUT:
                timeout(t, obj)
            else:
                inst = obj
                if inst.wake_at <= t:
                    inst.wake_at = math.inf
                    schedule(inst, t)
            if progress is not None and t >= next_report:
                progress(min(t, self.w_end))
                next_report = t + (self.w_end if math.isfinite(self.w_end) else 3600.0) / 200.0
        self.end_time = max((i.last_t for i in self.insts), default=0.0)
        uspan, imb = self._close()
        res = metrics.result(self, time.perf_counter() - wall0, uspan, imb)
        self.scheduler.finish(res)
        return res

    def _start_session(self, s: SessionStart) -> None:
        """Schedule the first turn of each agent stream of the session copy ``s``."""
        for ridx in self.stream_heads[s.session]:
            tr = self.trace.requests[ridx]
            t = s.start + tr.offset / s.time_scale
            if t < self.horizon:
                self.push(t, ARRIVE, (tr, s))

    # ------------------------------------------------------------------ routing
    def _arrive(self, now: float, item) -> None:
        """An attempt arrives (``item``: trace request, session copy, and the attempt when it
        is a client's retry): routed at once, or handed to the router's queue."""
        tr: TraceRequest
        tr, sess = item[0], item[1]
        att = None
        if self.clients is not None:
            att = self.retries.attempt(now, item)
        self.tally.issued += 1
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
            self.route(now, tr, sess, path, req, now, None, att)
            return
        self.queue.admit(now, tr, sess, path, req, att)

    def route(
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
            queue = self.queue
            if queue.affinity is not None and queue.unbind_now(view, mask, L):
                self.tally.unbound += 1
                mask = None  # routed over every instance (stack/dispatch/bypass.py)
            else:
                for v, ok in zip(views, mask):
                    v.healthy = ok
        d = self.policy.choose(req, view)
        inst = self.insts[d.instance]
        c = views[d.instance].local_hit
        qwait = now - arrival
        if att is not None:
            arrival = att.first
        feat = self.policy.feedback(req, views[d.instance])
        matched = not self.at_schedule
        if g > c:
            # the rest of the prefix comes from the global tier over this instance's link
            glob = g - c
            ready_at = inst.link.fetch(now, glob)
            fwait = ready_at - now
        else:
            glob = 0
            ready_at = now
            fwait = 0.0
        new = L - c - glob
        est = self.cost.cost(new, L)
        measured = self.w_start <= arrival <= self.w_end
        job = Job(
            tr, sess, path, req, d.kind, feat, arrival, qwait, measured, att,
            matched, c, glob, ready_at, fwait, new, est,
        )  # fmt: skip
        if att is not None:
            att.job = job
            att.inst = inst
        if self.hr is not None:
            # the least queued work on any instance as this request is placed (imbalance)
            self.hr_qmin[id(job)] = min(v.queued_seconds for v in views)
        if mask is not None:
            for v in views:
                v.healthy = True
        if c and path and matched:
            inst.cache.touch(path, c // bs + 1)
        accrue(inst, now, self.window_s)
        inst.n_jobs += 1
        inst.a_tokens += L
        inst.q_tokens += new
        inst.q_seconds += est
        if self.prio:
            slo = self.cfg.slo
            enqueue_by_class(inst.waiting, job, priority_class(slo.ttft(L) - qwait, slo))
        else:
            inst.waiting.append(job)
        self._schedule(inst, now)
        return inst

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
            accrue(inst, self.end_time, self.window_s)
        imb = metrics.imbalance(self.insts, self.cfg.window_s, self.w_start, self.w_end)
        tally = self.tally
        queued = self.queue.depth()
        if not tally.conserved(queued):
            # conservation: every admitted attempt is served once, rejected explicitly, or
            # taken back when its client gave up
            raise RuntimeError(
                f"dispatch lost requests: issued {tally.issued}, served {tally.served}, "
                f"rejected {tally.rejected}, cancelled {tally.cancelled}, still queued {queued}"
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
