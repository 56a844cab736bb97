"""Prefill batching on a simulated instance: which requests enter the next forward, what the
forward costs, and what its end leaves behind.

This follows SGLang's prefill scheduler. A forward takes the unfinished chunked request
first, then waiting requests in order, up to a token budget (``--chunked-prefill-size``);
a request larger than what is left of the budget is chunked and goes on in the next
forward. A request whose global-tier fetch is still in flight is skipped until its KV has
arrived. A forward costs ``c_fwd + sum(c_linear*n + c_attn*n*(end - n/2) +
c_prefix*(end - n)^2/2)`` over its chunks.

When a request's prefill completes, its KV goes into the instance's prefix cache and the
global tier, the policy learns from its TTFT, and its figures go into the run's
:class:`~stack.sim.tally.Tally`. What follows the first token (the answer, the next turn)
is the mode's scheduler's (stack/sim/scheduler.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from stack.sim import clients as cl
from stack.sim.events import WAKE, WRITTEN
from stack.sim.instance import Instance, Job, accrue

if TYPE_CHECKING:
    from stack.sim.engine import Simulator


class Batcher:
    """The prefill batches of ``sim``'s instances (module docstring)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.cost = sim.cost
        self.chunk = sim.chunk
        self.bs = sim.bs
        self.glob = sim.glob
        self.write_link = sim.write_link
        self.policy = sim.policy
        self.slo = sim.cfg.slo
        self.window_s = sim.cfg.window_s
        self.pd = sim.cfg.mode == "pd"
        self.tally = sim.tally
        self.push = sim.push
        # the scheduler's hooks, bound once: called per batch and request
        sched = sim.scheduler
        #: seconds the PD hand-off adds to a prompt's first token (None: not charged)
        self.handoff_s = getattr(sched, "handoff_s", None)
        #: finished prefills wait in ``inst.handing`` for the scheduler's :meth:`hand_over`
        self.between_forwards = bool(getattr(sched, "between_forwards", False))
        self._fits = sched.fits
        self._admit = sched.admit
        self._first_token = sched.first_token

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
                self.tally.rematch_short += 1
                self.tally.rematch_short_tokens += c - c2
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
                if j.att is not None and j.att.state == cl.ABANDONED and self.pd:
                    self.sim.retries.abort_started(now, inst, j)
                    continue
                est = cost.cost(j.rem, j.L)
                inst.q_seconds += est - j.est
                j.est = est
                inst.chunked = j
            else:
                inst.q_seconds -= j.est
                j.est = 0.0
                self._prefill_done(now, inst, j)
                if self.between_forwards:
                    inst.handing.append(j)
                else:
                    self._first_token(now + self._handed_over(now, inst, j), inst, j)
        inst.batch.clear()
        if inst.n_jobs == 0:
            inst.q_seconds = 0.0  # drop float drift

    def hand_over(self, now: float, inst: Instance) -> None:
        """``inst`` hands over the prefills in ``inst.handing`` at ``now`` (``between_forwards``:
        the end of the pass after the one that finished them, or their own if it ran no other)."""
        for j in inst.handing:
            self._first_token(now + self._handed_over(now, inst, j), inst, j)
        inst.handing.clear()

    def _prefill_done(self, now: float, inst: Instance, j: Job) -> None:
        """``j``'s prefill completed at ``now``: the instance's counts and the caches."""
        accrue(inst, now, self.window_s)
        inst.n_jobs -= 1
        inst.a_tokens -= j.L
        tally = self.tally
        tally.served += 1
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

    def _handed_over(self, now: float, inst: Instance, j: Job) -> float:
        """``j``'s prefill is handed over at ``now``: TTFT metrics. Returns the seconds its
        first token then takes to reach the client (the PD hand-off; 0 when not charged)."""
        tally = self.tally
        ttft = now - j.arrival
        hand = 0.0
        if self.handoff_s is not None:  # the first token reaches the client after the hand-off
            hand = self.handoff_s(j.L)
            ttft += hand
        if j.feat is not None:
            self.policy.observe(j.req, inst.idx, j.feat, ttft)
        sim = self.sim
        hr = sim.hr
        att = j.att
        if att is not None:
            if att.state != cl.LIVE:  # its client gave up on it: the answer reaches nobody
                if j.measured:
                    tally.abandoned_served += 1
                if hr is not None:
                    sim.hr_qmin.pop(id(j), None)
                return hand
            att.state = cl.ANSWERED
        sess = j.copy
        sim.sessions.first_token(sess.copy, sess.start, j.tr, ttft)
        if j.measured:
            L = j.L
            tally.count_served(j, ttft, self.slo.ttft(L))
            if hr is not None:
                hr.append(
                    (j.tr.idx, j.arrival, j.qwait, j.fwait, j.fetched, L - j.local - j.glob, L,
                     ttft, sim.hr_qmin.pop(id(j), 0.0))
                )  # fmt: skip
        elif hr is not None:
            sim.hr_qmin.pop(id(j), None)
        return hand
