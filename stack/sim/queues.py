"""The router's queue in the simulator: when the requests that arrive leave for an instance.

The order and its rules are the shared dispatcher's (stack/dispatch, the same code the live
router runs); this module drives it from the simulator's events. An arriving request is
admitted to a queue (or dispatched at once: ``immediate``, or the ``bypass`` rule for a
link-bound one); each cycle (:meth:`RouterQueue.pump`) answers what waited too long with an
overload answer, releases requests while an instance is ready (the policy choosing among the
ready ones; the ``affinity`` rule may widen that to every instance) and sets the queue's
next timer.

Several router replicas hold one queue each, all over the same instances; how they share
the release is ``replica_mode`` (docs/research/dispatch.md, "Router replicas"): ``own`` and
``claims`` spread arrivals round-robin, as a load balancer in front of them would, and
release in turns or by one cluster-wide rank; ``leader`` forwards every request to one
replica; ``hash`` keeps a session on one replica. The replicas share one memory of the
requests refused for their wait (:mod:`stack.dispatch.refusals`), as the live router's do
through Redis: a client's retry is known whichever replica it reaches.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from stack.core.types import ClusterView, InstanceState, Request
from stack.dispatch import Dispatcher, Entry, Rejected, estimate_size
from stack.dispatch.bypass import unbind_at_release
from stack.dispatch.refusals import Refusals
from stack.sim import clients as cl
from stack.sim.events import QUEUE_TIMER
from stack.sim.instance import Instance
from stack.sim.load import SessionStart
from stack.sim.view import build_view
from stack.traces.model import TraceRequest

if TYPE_CHECKING:
    from stack.sim.engine import Simulator


class RouterQueue:
    """The router replicas' queues in front of ``sim``'s instances (module docstring)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.insts = sim.insts
        self.cost = sim.cost
        self.bs = sim.bs
        self.glob = sim.glob
        self.fetch_tokens_per_s = sim.fetch_tokens_per_s
        self.view = sim.view
        self.slo = sim.cfg.slo
        self.tally = sim.tally
        spec = sim.cfg.dispatch
        self.replica_mode = (spec.replica_mode or "own") if spec.replicas > 1 else "own"
        # one memory of the requests refused for their wait: a retry reaches any replica
        refusals = Refusals()
        self.disps = [spec.build(refusals) for _ in range(spec.replicas)]
        self.disp = self.disps[0]
        # with ``immediate`` every request is routed at its arrival
        self.late = not self.disp.immediate
        # ``bypass``: link-bound requests dispatched at arrival (stack/dispatch/bypass.py);
        # None (off, and always without a global tier): every request is queued
        self.bypass = self.disp.bypass if self.glob is not None else None
        # ``affinity``: a released request not held to the ready instances where that would
        # make it link-bound (stack/dispatch/bypass.py, unbind_at_release)
        self.affinity = self.disp.affinity if self.glob is not None else None
        # the instances' load as the dispatcher reads it (refreshed before each release)
        self.loads = [InstanceState(i) for i in range(len(self.insts))]
        self.timer_at = math.inf

    def admit(
        self,
        now: float,
        tr: TraceRequest,
        sess: SessionStart,
        path: tuple,
        req: Request,
        att: cl.Attempt | None,
    ) -> None:
        """``req`` (of ``tr``, prompt keys ``path``) arrives at a router with a queue: dispatched
        at once under the bypass rule, else admitted to its replica's queue (or answered
        with an overload answer); then a cycle runs."""
        sim = self.sim
        L = tr.input_len
        if self.bypass is not None and self.bypass_now(now, path, L):
            self.tally.bypassed += 1
            self.replica_of(sess).bypassed(self.slo.ttft(L))
            sim.route(now, tr, sess, path, req, now, None, att)
            return
        # the prompt's fingerprint, as the live router's: its length and last block
        key = (L, path[-1]) if path else None
        e = Entry((tr, sess, path, att), req, now, self.slo.ttft(L), estimate_size(self.cost, req), key=key)
        disp = self.replica_of(sess)
        if att is not None:
            att.entry = e
            att.disp = disp
        r = disp.admit(e, now)
        depth = self.depth()
        if depth > self.tally.queue_depth_max:
            self.tally.queue_depth_max = depth
        if r is not None:
            self.reject(now, r)
        self.pump(now)

    def bypass_now(self, now: float, path, L: int) -> bool:
        """Whether the dispatcher's bypass rule dispatches this request at once: its
        global-tier fetch beyond the best local hit, behind the least link backlog, takes
        longer than its compute (:meth:`stack.dispatch.bypass.Bypass.on_view`)."""
        if not path:
            return False
        view = build_view(now, self.insts, path, L, self.bs, self.glob, self.fetch_tokens_per_s, self.view)
        return self.bypass.on_view(view, L, self.cost)

    def unbind_now(self, view: ClusterView, mask: list[bool], L: int) -> bool:
        """Whether the dispatcher's affinity rule routes a request released to the ``mask``
        instances over every instance instead (:func:`stack.dispatch.bypass.unbind_at_release`)."""
        return unbind_at_release(self.affinity, view, mask, L, self.cost)

    def replica_of(self, sess: SessionStart) -> Dispatcher:
        """The replica whose queue holds an arriving request: round-robin (``own``,
        ``claims``: a load balancer in front of the replicas), the leader's (``leader``: the
        replica that took it forwards it), or by its session (``hash``)."""
        disps = self.disps
        n = len(disps)
        if n == 1 or self.replica_mode == "leader":
            return disps[0]
        if self.replica_mode == "hash":
            return disps[(sess.copy * 2654435761 & 0xFFFFFFFF) % n]
        return disps[self.tally.issued % n]

    def load(self, inst: Instance, now: float) -> None:
        """Refresh what the dispatcher reads of ``inst``'s load."""
        s = self.loads[inst.idx]
        s.queued_seconds = inst.q_seconds
        s.running = inst.n_jobs
        fb = inst.link.free_at - now
        s.fetch_backlog_s = fb if fb > 0 else 0.0

    def depth(self) -> int:
        """Requests queued over every replica."""
        return sum(d.counters.depth for d in self.disps)

    def timer(self, now: float) -> None:
        """The queue's timer went off: a cycle (a stale timer's cycle is harmless)."""
        if self.timer_at <= now:
            self.timer_at = math.inf
        self.pump(now)

    def release_queued(self, now: float) -> None:
        """Work left an instance: release queued requests before it picks its next batch."""
        if self.late and self.depth():
            self.pump(now)

    def pump(self, now: float) -> None:
        """Run the dispatcher's cycle: reject what waited too long, release entries while
        an instance is ready (the policy choosing among the ready ones), set the timer."""
        route = self.sim.route
        disps = self.disps
        for disp in disps:
            for r in disp.expire(now):
                self.reject(now, r)
            for e in disp.take_overdue():  # a retry at its bound: routed at once, everywhere
                tr, sess, path, att = e.handle
                route(now, tr, sess, path, e.request, e.arrival, None, att)
        if not self.depth():
            return
        loads = self.loads
        for inst in self.insts:
            self.load(inst, now)
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
                inst = route(now, tr, sess, path, e.request, e.arrival, disp.ready_mask(loads), att)
                self.load(inst, now)
        t = min(disp.next_timer(now, loads) for disp in disps)
        if t < self.timer_at:
            self.timer_at = t
            self.sim.push(t, QUEUE_TIMER, None)

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
            inst = self.sim.route(now, tr, sess, path, e.request, e.arrival, best.ready_mask(loads), att)
            self.load(inst, now)

    def reject(self, now: float, r: Rejected) -> None:
        """An explicit overload answer (a live router's 503 / 529): the attempt is not
        served. Without a client model its agent stream ends there; with one, the client
        retries after the answer's Retry-After while it has retries left."""
        sim = self.sim
        tally = self.tally
        tally.rejected += 1
        if r.waited_s > tally.rejected_wait_max:
            tally.rejected_wait_max = r.waited_s
        tr, sess, _, att = r.entry.handle
        if att is None:
            if sim.w_start <= r.entry.arrival <= sim.w_end:
                tally.rejected_measured += 1
            sim.sessions.failed_turn(sess.copy, sess.start, tr.session)
            return
        att.state = cl.REFUSED
        measured = sim.w_start <= att.first <= sim.w_end
        if measured:
            tally.refusals += 1
        # Retry-After: the refusing queue's drain estimate, the router's rule
        wait = att.disp.retry_after(len(self.insts))
        sim.retries.retry_or_fail(now, r.entry.handle, wait, measured, refused=True)

    def cancel(self, e: Entry) -> bool:
        """Take ``e`` out of whichever replica's queue holds it (its client gave up); whether
        one did."""
        for d in self.disps:
            if d.cancel(e):
                return True
        return False
