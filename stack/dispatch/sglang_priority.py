"""Coarse priority classes: the order an instance computes its waiting requests in, one rule
for the live router (``router.dispatch.sglang_priority``; docs/router.md) and the simulator
(the dispatch key ``prio=1``; docs/research/dispatch.md, "Priority at the instance").

**The rule** (:func:`priority_class`): a request's class is the bucket of its *slack* when
it is dispatched to an instance (its deadline, arrival + ``SLO.ttft(L)``, less now), in units
of the SLO's base term ``b`` (the SLO of an empty prompt; 1 s if ``b`` is 0), on a
half-octave scale: class ``k`` holds slack within a factor 2^(1/4) of ``sqrt(2)^k`` units,
i.e. up to ``2^((k + 1/2) / 2)`` units: class 0 up to 1.19 units (a fresh short prompt,
slack about 1 unit, sits in its middle, not on an edge; a request already past its deadline
is class 0 too), class 1 up to 1.68, ..., class 6 up to 9.5, class ``N_CLASSES - 1`` above.
Class 0 computes first. It is earliest-deadline-first at the resolution of a factor
sqrt(2) in slack; a request dispatched at its arrival (the ``immediate`` order) has slack
``SLO.ttft(L)``, so there the class is a bucket of its SLO, i.e. of its prompt length.

**Why classes and not the deadline itself.** SGLang 0.5.23 keeps one Prometheus label per
distinct priority value it has ever seen (``observability/metrics_collector.py``: the
queue-count gauges add every ``req.priority`` to ``_known_priorities`` and report each one
from then on), so a priority per millisecond of deadline grows the worker's metrics without
bound. :data:`N_CLASSES` values bound it.

**How SGLang 0.5.23 orders them** (read in its source; the emulator and the simulator model
this): ``SchedulePolicy.calc_priority`` (``managers/schedule_policy.py``), with
``--enable-priority-scheduling`` and ``--schedule-policy fcfs``, sorts the waiting queue in
``SchedulePolicy._sort_by_priority_and_fcfs`` by ``priority * sign`` then the time the
request entered the waiting queue, ``sign = -1`` unless ``--schedule-low-priority-values-first``:
by default the HIGHEST value runs first, so :func:`class_priority` sends
``N_CLASSES - 1 - class``. The sort runs at every prefill batch
(``Scheduler._get_new_batch_prefill_raw`` in ``managers/scheduler.py``), and the chunked
request of the previous forward enters the batch before any waiting one: a request being
computed finishes first.
``Scheduler.__init__`` sets ``enable_priority_preemption`` only when priority scheduling is
on and ``--disable-priority-preemption`` is not given; without it no running request is
ever preempted for a waiting one (``PrefillAdder.preempt_to_schedule`` is then not called).
A request without a priority gets SGLang's lowest (``Scheduler._set_or_validate_priority``),
below every class. The launcher sets both flags and ``--schedule-policy fcfs``
(``stack/launch/sglang_worker.py``, ``priority_args``).
"""

from __future__ import annotations

from bisect import bisect_left

from stack.core.types import SLO

#: how many classes (and distinct SGLang priority values) there are
N_CLASSES = 8
#: class edges in units of the SLO's base: slack <= EDGES[k] units is class <= k
EDGES: tuple[float, ...] = tuple(2.0 ** ((k + 0.5) / 2) for k in range(N_CLASSES - 1))


def slo_unit(slo: SLO) -> float:
    """The slack unit of :func:`priority_class`: the SLO's base term, 1 s if it is 0."""
    return slo.b if slo.b > 0 else 1.0


def priority_class(slack_s: float, slo: SLO) -> int:
    """The class (0 computes first, ``N_CLASSES - 1`` last) of a request with ``slack_s``
    seconds left to its deadline when it is dispatched, under ``slo`` (module docstring)."""
    return bisect_left(EDGES, slack_s / slo_unit(slo))


def class_priority(cls: int) -> int:
    """The SGLang ``priority`` of class ``cls``: higher runs first, SGLang's default
    direction (no ``--schedule-low-priority-values-first``)."""
    if not 0 <= cls < N_CLASSES:
        raise ValueError(f"priority class must be in 0..{N_CLASSES - 1}, got {cls!r}")
    return N_CLASSES - 1 - cls


def dispatch_priority(slo_s: float, waited_s: float, slo: SLO) -> int:
    """The SGLang ``priority`` of a request whose SLO is ``slo_s`` seconds, dispatched
    ``waited_s`` seconds after its arrival (the live router's call)."""
    return class_priority(priority_class(slo_s - waited_s, slo))
