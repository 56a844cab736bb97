"""The timing fields SGLang's ``meta_info`` carries with ``--enable-metrics``, from the
emulator's modelled clock.

SGLang 0.5.23 (``--enable-metrics``) adds to every answer's ``meta_info``: ``queue_time``
(seconds from entering the scheduler's waiting queue to the first forward),
``forward_entry_time`` and ``prefill_finished_time`` (wall-clock timestamps of the first
forward that carried the request and of the end of its prefill) and ``request_received_ts``.
Without the flag none of them is there, and the emulator does the same
(``WorkerSettings.enable_metrics``).

The emulator's timestamps are anchored at the request's real arrival (wall clock) and then
advance on the modelled clock: ``prefill_finished_time - forward_entry_time`` is the modelled
seconds of the request's forwards and ``queue_time`` the modelled seconds it waited, whatever
the worker's ``time_factor``. A client that reads them (``smetric calibrate``, the router's
learned cost model) needs no time factor; one that times the wall clock divides by it.
"""

from __future__ import annotations

import time
from typing import Any

from stack.worker.request import Req


def metrics_meta(req: Req, time_factor: float, prefilled: bool) -> dict[str, Any]:
    """``meta_info``'s timing fields of ``req`` (``prefilled``: this worker ran its prefill;
    a decode worker reports its arrival and no queueing)."""
    now_wall, now_mono = time.time(), time.monotonic()
    received = now_wall - (now_mono - req.t_arrive)
    out: dict[str, Any] = {"request_received_ts": received, "queue_time": 0.0}
    if not prefilled or not req.t_forward_entry or not req.t_prefill_done:
        return out
    tf = time_factor if time_factor > 0 else 1.0
    queue = max(0.0, req.t_forward_entry - req.t_arrive) / tf
    forward = max(0.0, req.t_prefill_done - req.t_forward_entry) / tf
    out["queue_time"] = queue
    out["forward_entry_time"] = received + queue
    out["prefill_finished_time"] = received + queue + forward
    return out
