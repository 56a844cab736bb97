"""How the simulated instances run their work: the hooks the engine calls.

The engine (stack/sim/engine.py) routes requests to instances and its batcher
(stack/sim/batching.py) forms prefill batches and counts finished prefills; a
:class:`Scheduler` decides the rest for its mode: when an instance starts a forward and what
it costs, whether a request may enter its first batch (KV room), what happens when a forward
ends and after a request's first token, and what the mode adds to the result.
:class:`PDScheduler` is PD disaggregation (prefill only, decode in another pool);
:class:`~stack.sim.colocated.ColocatedScheduler` is PD colocation.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from stack.sim.config import SimResult
from stack.sim.events import FORWARD_DONE
from stack.sim.instance import Instance, Job, Link, window_overlap

if TYPE_CHECKING:
    from stack.core.cost_model import CostModel
    from stack.sim.config import SimConfig

InstT = TypeVar("InstT", bound=Instance)


class Host(Protocol):
    """What a scheduler may use of the engine it is composed with
    (:class:`~stack.sim.engine.Simulator` is the one host)."""

    cfg: SimConfig
    cost: CostModel
    bs: int
    insts: list[Any]
    w_start: float
    w_end: float

    def push(self, t: float, kind: int, obj: Any) -> None: ...

    def form_batch(self, inst: Any, now: float) -> float: ...

    def apply_batch(self, now: float, inst: Any) -> None: ...

    def hand_over(self, now: float, inst: Any) -> None: ...

    def release_queued(self, now: float) -> None: ...

    def answered(self, j: Job, answered: float) -> None: ...

    @property
    def load(self) -> Any: ...


class Scheduler(Protocol[InstT]):
    """The mode-specific part of the simulator (module docstring); ``InstT``: its instance type."""

    def new_instance(self, idx: int, cap_blocks: int, link: Link, locking: bool) -> InstT:
        """A fresh instance of ``cap_blocks`` prefix-cache blocks on ``link``."""
        ...

    def schedule(self, inst: InstT, now: float) -> None:
        """Work may run on ``inst`` (a routed request, a fetch done, a forward ended)."""
        ...

    def fits(self, inst: InstT, j: Job) -> bool:
        """Whether ``j`` may enter its first batch now (``False``: it and the queue behind it wait)."""
        ...

    def admit(self, inst: InstT, j: Job) -> None:
        """``j`` enters its first batch (sets ``j.admitted``)."""
        ...

    def forward_done(self, now: float, payload: Any) -> None:
        """A ``FORWARD_DONE`` event's handler (``payload``: what :meth:`schedule` pushed)."""
        ...

    def first_token(self, now: float, inst: InstT, j: Job) -> None:
        """``j``'s first token reached its client at ``now`` (its prefill's end plus the PD
        hand-off, if charged; caches and TTFT already counted): what follows."""
        ...

    def finish(self, res: SimResult) -> None:
        """The run is over: check the mode's invariants, add its metrics to ``res``."""
        ...


class PDScheduler:
    """PD disaggregation: an instance runs one prefill forward at a time; a request's answer
    is complete ``output_len * tpot`` after its first token, which reaches the client the
    hand-off's seconds after its prefill (decode in another pool). With a measured spread
    (``handoff.spread_s``) each request's hand-off is drawn from it, seeded by the load's seed.
    With ``handoff.between_forwards`` an instance hands its finished prefills over after its
    next pass: at the end of the forward it starts as they finish, if it starts one."""

    def __init__(self, sim: Host) -> None:
        self.sim = sim
        hw = sim.cfg.hardware
        self.tpot = hw.decode_tpot_s
        #: the typical hand-off (a session alone is priced with it)
        self.handoff_typical = None if hw.handoff.off else hw.handoff_s
        #: one request's hand-off (None: not charged)
        self.handoff_s = self.handoff_typical
        if hw.handoff.spread_s:
            rng = random.Random(f"handoff-{sim.load.seed}")
            draw = hw.handoff_drawn
            self.handoff_s = lambda L: draw(L, rng.random())
        #: finished prefills are handed over between forwards (:meth:`forward_done`)
        self.between_forwards = hw.handoff.between_forwards

    def new_instance(self, idx: int, cap_blocks: int, link: Link, locking: bool) -> Instance:
        return Instance(idx, cap_blocks, link, locking)

    def schedule(self, inst: Instance, now: float) -> None:
        self._start(inst, now)

    def _start(self, inst: Instance, now: float) -> float:
        """Start ``inst``'s next forward if it is idle and has work; returns when the pass
        ends: the forward's end, or ``now`` when none starts."""
        if inst.busy:
            return now
        sim = self.sim
        t = sim.form_batch(inst, now)
        if not inst.batch:
            return now
        inst.busy = True
        inst.busy_s += t
        end = now + t
        inst.busy_w += window_overlap(now, end, sim.w_start, sim.w_end)
        sim.push(end, FORWARD_DONE, inst)
        return end

    def fits(self, inst: Instance, j: Job) -> bool:
        return True  # no KV gate: the prefill pool's room is the prefix cache's

    def admit(self, inst: Instance, j: Job) -> None:
        j.admitted = True

    def forward_done(self, now: float, inst: Instance) -> None:
        inst.busy = False
        sim = self.sim
        sim.apply_batch(now, inst)
        sim.release_queued(now)
        end = self._start(inst, now)
        if inst.handing:  # between forwards: after the pass that has just begun, if any
            sim.hand_over(end, inst)

    def first_token(self, now: float, inst: Instance, j: Job) -> None:
        self.sim.answered(j, now + j.tr.output_len * self.tpot)

    def finish(self, res: SimResult) -> None:
        pass
