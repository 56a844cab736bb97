"""Clients that give up and retry, in the simulator (the model is stack/sim/clients.py).

Each attempt starts a patience timer. When it runs out before the first token, the client
abandons the attempt: the router takes it back (out of its queue, or off the instance it
waits on; a chunked prefill already under way stops at its next chunk boundary, PD mode
only) and the client retries after its delay while it has retries left. An overload answer
from the router's queue leads to the same choice, the delay then honouring Retry-After.
A request out of retries has failed, and its agent stream ends there. A measured request's
retries go on after the run's last arrival; an unmeasured one's stop there.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from stack.sim import clients as cl
from stack.sim.events import ARRIVE, CLIENT_TIMEOUT
from stack.sim.instance import Instance, Job, accrue

if TYPE_CHECKING:
    from stack.sim.engine import Simulator


class ClientRetries:
    """The clients of ``sim``'s requests (module docstring); ``sim.cfg.clients`` is their model."""

    def __init__(self, sim: Simulator, seed: int) -> None:
        self.sim = sim
        self.model = sim.cfg.clients
        self.rng = random.Random(seed)
        self.tally = sim.tally
        self.window_s = sim.cfg.window_s
        self.pd = sim.cfg.mode == "pd"

    def attempt(self, now: float, item: tuple) -> cl.Attempt:
        """The attempt of an arrival (``item``: what its ARRIVE event carries): a retry carries
        its own, a first attempt starts one; its patience starts now."""
        sim = self.sim
        att = item[2] if len(item) > 2 else cl.Attempt(1, now, now)
        if sim.w_start <= att.first <= sim.w_end:
            self.tally.attempts += 1
        sim.push(now + self.model.patience_s, CLIENT_TIMEOUT, att)
        return att

    def retry_or_fail(
        self, now: float, handle, retry_after: float | None, measured: bool, refused: bool
    ) -> None:
        """The client of the attempt in ``handle`` retries (a new arrival, after its delay)
        while it has retries left; else its request failed and its agent stream ends."""
        tr, sess, _, att = handle
        sim = self.sim
        cm = self.model
        if att.n <= cm.max_retries:
            at = now + cm.delay(att.n, retry_after, self.rng)
            # a measured request is followed to its outcome: its client's retries go on after
            # the last arrival (cutting them there would count the run's end as a failure)
            if at < sim.horizon or sim.mode == "compress" or measured:
                sim.push(at, ARRIVE, (tr, sess, att.retry(at)))
                return
        if measured:
            if refused:
                self.tally.rejected_measured += 1
            else:
                self.tally.failed += 1
        sim.sessions.failed_turn(sess.copy, sess.start, tr.session)

    def timeout(self, now: float, att: cl.Attempt) -> None:
        """A client's patience with ``att`` ran out: if it has no first token yet, the client
        abandons it (the router takes it back: out of its queue, or off its instance while it
        waits there; a chunked prefill under way stops at its next chunk boundary,
        :meth:`abort_started`; PD mode) and retries or fails."""
        if att.state != cl.LIVE:
            return
        att.state = cl.ABANDONED
        sim = self.sim
        measured = sim.w_start <= att.first <= sim.w_end
        if measured:
            self.tally.timeouts += 1
        e = att.entry
        if att.job is None and e is not None:
            if sim.queue.cancel(e):
                self.tally.cancelled += 1
            handle = e.handle
        else:
            j = att.job
            if self.pd and j in att.inst.waiting:
                self._take_back(now, att.inst, j)
            handle = (j.tr, j.copy, j.path, att)
        self.retry_or_fail(now, handle, None, measured, refused=False)

    def _take_back(self, now: float, inst: Instance, j: Job) -> None:
        """The router cancels ``j``, still waiting on ``inst`` (no token of it computed):
        off the instance, its locks released (a fetch booked for it stays spent)."""
        inst.waiting.remove(j)
        self._unbook(inst, now, j)
        self.sim.scheduler.schedule(inst, now)

    def _unbook(self, inst: Instance, now: float, j: Job) -> None:
        """Take cancelled ``j``'s share off ``inst``'s figures and release its cache locks."""
        accrue(inst, now, self.window_s)
        inst.n_jobs -= 1
        inst.a_tokens -= j.L
        inst.q_tokens -= j.rem
        inst.q_seconds -= j.est
        if inst.n_jobs == 0:
            inst.q_seconds = 0.0
        if j.held is not None:
            inst.cache.unlock(j.held)  # type: ignore[attr-defined]
            j.held = None
        self.tally.cancelled += 1

    def abort_started(self, now: float, inst: Instance, j: Job) -> None:
        """``j``'s client gave up during its chunked prefill: the router aborts it, and the
        engine stops it at the chunk boundary (SGLang 0.5.23 drops an aborted chunked request
        before its next chunk; the KV computed so far is freed, not cached)."""
        self._unbook(inst, now, j)
        j.est = 0.0
