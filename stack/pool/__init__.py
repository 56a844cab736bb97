"""The worker pool: membership, health and load accounting (booking) of SGLang workers.

One package serves every part that needs to know the workers: the prefill router (routing
view, booking), the decode router (decode choice, the PD hand-off's addresses) and the
router replicas' shared state (publishing each replica's accounting). Keeping it out of
``stack.prefill_router`` lets ``stack.decode_router`` depend on the pool alone.

- :mod:`stack.pool.worker`: one worker's record and its load views (:data:`LOAD_FRESH_S`).
- :mod:`stack.pool.registry`: membership, ejection/readmission, per-request accounting.
- :mod:`stack.pool.booking`: one request's accounting on its prefill and decode worker.
- :mod:`stack.pool.health`: the health-check and ``/v1/loads`` polling loop.
- :mod:`stack.pool.loop_watch`: the router's own event-loop stalls (failures in them do not count).
"""

from stack.pool.booking import Booking
from stack.pool.health import HealthChecker, parse_loads
from stack.pool.loop_watch import LoopWatch
from stack.pool.registry import LINK_SCOPES, WorkerRegistry
from stack.pool.worker import LOAD_FRESH_S, Ticket, Worker

__all__ = [
    "LINK_SCOPES",
    "LOAD_FRESH_S",
    "Booking",
    "HealthChecker",
    "LoopWatch",
    "Ticket",
    "Worker",
    "WorkerRegistry",
    "parse_loads",
]
