"""The timing fields SGLang's ``meta_info`` carries with ``--enable-metrics``, from the
emulator's modelled clock.

SGLang 0.5.23 (``--enable-metrics``) adds to every answer's ``meta_info``: ``queue_time``
(seconds from entering the scheduler's waiting queue to the first forward),
``forward_entry_time`` and ``prefill_finished_time`` (Unix timestamps of the first forward
that carried the request and of the end of its prefill) and ``request_received_ts``. Without
the flag none of them is there, and the emulator does the same
(``WorkerSettings.enable_metrics``).

The emulator's timestamps are on its modelled timeline: the worker's start (wall clock) plus
the wall seconds since, divided by the time factor. Their differences are modelled seconds
whatever the worker's ``time_factor`` (``prefill_finished_time - forward_entry_time``: the
modelled seconds of the request's forwards), and the intervals of two requests of one worker
overlap exactly when their forwards did. At a time factor below 1 the timeline runs ahead of
the wall clock. A client that reads them (``smetric calibrate``, the router's learned cost
model) needs no time factor; one that times the wall clock divides by it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from stack.worker.request import Req


@dataclass(frozen=True, slots=True)
class ModelTimeline:
    """Wall (monotonic) instants to Unix timestamps on the modelled timeline."""

    time_factor: float
    wall0: float = field(default_factory=time.time)
    mono0: float = field(default_factory=time.monotonic)

    def ts(self, mono: float) -> float:
        tf = self.time_factor if self.time_factor > 0 else 1.0
        return self.wall0 + (mono - self.mono0) / tf


def metrics_meta(req: Req, timeline: ModelTimeline, prefilled: bool) -> dict[str, Any]:
    """``meta_info``'s timing fields of ``req`` (``prefilled``: this worker ran its prefill;
    a decode worker reports its arrival and no queueing)."""
    out: dict[str, Any] = {"request_received_ts": timeline.ts(req.t_arrive), "queue_time": 0.0}
    if not prefilled or not req.t_forward_entry or not req.t_prefill_done:
        return out
    entry = max(req.t_forward_entry, req.t_arrive)
    out["queue_time"] = timeline.ts(entry) - out["request_received_ts"]
    out["forward_entry_time"] = timeline.ts(entry)
    out["prefill_finished_time"] = timeline.ts(max(req.t_prefill_done, entry))
    return out
