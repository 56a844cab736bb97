"""The ``priority`` the router gives a request on workers run with SGLang's
``--enable-priority-scheduling`` (``router.dispatch.sglang_priority``; docs/router.md).

SGLang 0.5.23 sorts its waiting queue by ``priority * sign`` then arrival
(``SchedulePolicy._sort_by_priority_and_fcfs``), with ``sign = -1`` unless the worker runs
``--schedule-low-priority-values-first``: by default the HIGHEST value runs first. The
decode side sorts its pre-allocation queue the same way (``disaggregation/decode.py``).

The mapping: ``priority = -round((deadline - EPOCH) * 1000)``, the deadline in wall-clock
seconds (``time.time()`` at arrival + the router's ``SLO.ttft(L)``, the deadline the dispatch
queue orders by). It is strictly decreasing in the deadline at millisecond resolution, so an
earlier deadline is a higher value and the worker's queue order equals the router's deadline
order (deadlines within the same millisecond tie and SGLang breaks the tie by arrival, as
the router does). Wall clock, not ``time.monotonic``, so router replicas in front of one pool
agree (up to their clock skew). Milliseconds since 2024-01-01 are ~1e11 for decades: far
inside the signed 64-bit range SGLang accepts (an int32 would overflow after 24 days, so no
int32 clamp). The value is clamped above SGLang's own priority for a request that gives
none (``-sys.maxsize - 1``) so a routed request never ties with an unprioritised one.
"""

from __future__ import annotations

#: 2024-01-01T00:00:00Z: a fixed epoch, the same on every replica
EPOCH_S = 1_704_067_200.0
I64_MAX = (1 << 63) - 1
#: one above SGLang's default for "no priority" (-sys.maxsize - 1 when high values run first)
I64_MIN = -(1 << 63) + 1


def deadline_priority(deadline_s: float) -> int:
    """The SGLang ``priority`` of a request due at ``deadline_s`` (wall-clock seconds):
    earlier deadline -> higher integer."""
    v = -round((deadline_s - EPOCH_S) * 1000.0)
    return I64_MIN if v < I64_MIN else I64_MAX if v > I64_MAX else v
