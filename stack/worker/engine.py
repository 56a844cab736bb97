"""The emulated engine: the parts one worker is built from, and their life cycle.

:class:`Engine` assembles a chunked-prefill scheduler over a real prefix cache
(:mod:`stack.worker.scheduler`, :mod:`stack.worker.cache`), the KV-event publisher
(:mod:`stack.worker.events`), a global tier in Mooncake (:mod:`stack.worker.global_tier`) and
the PD hand-off over the TransferEngine (:mod:`stack.worker.pd_handoff`); it starts and stops
them together and aborts requests across them. Everything else is done by the part that owns
it: callers (the request path in :mod:`stack.worker.request_path`, the HTTP layer) reach the
parts as attributes, e.g. ``engine.scheduler.prefill(req)`` or ``engine.handoff.send_kv(req)``.
The paced decode output is :mod:`stack.worker.output`; the load a worker reports is
:mod:`stack.worker.load`.

Time: every modelled GPU second takes ``time_factor`` real seconds on the modelled clock
(:mod:`stack.worker.clock`): steps end at deadlines, so the emulator's own host work overlaps
the modelled compute instead of adding to it, and a worker that falls behind its clock warns.
Real I/O (Mooncake store reads/writes, TransferEngine writes) takes the time it takes and
counts in TTFT.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from stack.core.cost_model import Hardware, load_hardware
from stack.worker.cache import PrefixCache
from stack.worker.clock import ModelClock
from stack.worker.events import KVEventPublisher
from stack.worker.global_tier import GlobalTier
from stack.worker.pd_handoff import KVHandoff
from stack.worker.request import Aborted, Counters, GenParams, Req
from stack.worker.scheduler import PrefillScheduler
from stack.worker.settings import WorkerSettings
from stack.worker.tokenizer import load_tokenizer

# the request types callers import from here
__all__ = ["Aborted", "Engine", "GenParams", "Req"]

log = logging.getLogger("stack.worker")


class Engine:
    """One worker's parts: ``scheduler`` (prefill), ``cache`` (prefix cache), ``publisher``
    (KV events), ``tier`` (global tier), ``handoff`` (PD), ``clock`` (modelled time),
    ``tokenizer`` and the counters ``c``; ``decoding`` and ``tasks``: the requests past prefill
    and the request path's task of each request, which :meth:`abort` and :meth:`stop` cancel."""

    def __init__(self, s: WorkerSettings, hardware: Hardware | None = None):
        self.s = s
        self.hw = hardware or load_hardware(s.hardware)
        self.cost = self.hw.cost
        self.chunk_tokens = int(s.chunk_tokens or self.hw.chunk_tokens)
        cap_tokens = int(s.capacity_tokens or self.hw.hbm_kv_tokens)
        self.publisher = KVEventPublisher(
            s.kv_events_endpoint, s.kv_events_topic, s.dp_rank, s.kv_events_replay_endpoint
        )
        self.cache = PrefixCache(
            s.page_size, max(1, cap_tokens // s.page_size), on_event=self.publisher.publish
        )
        self.tokenizer = load_tokenizer(s.tokenizer)
        self.tpot = float(s.decode_tpot_s if s.decode_tpot_s is not None else self.hw.decode_tpot_s)
        self.c = Counters()
        self.clock = ModelClock(s.time_factor, name=s.name)
        self.tier = GlobalTier(s, self.hw, self.c)
        self.scheduler = PrefillScheduler(
            s.page_size, self.chunk_tokens, self.cost, self.cache, self.clock, self.tier, self.c,
            priority_scheduling=s.enable_priority_scheduling,
            low_priority_first=s.schedule_low_priority_values_first,
        )  # fmt: skip
        if s.enable_priority_scheduling and not s.disable_priority_preemption and s.mode != "decode":
            log.warning(
                "%s: --enable-priority-scheduling without --disable-priority-preemption: the "
                "emulator never preempts a running request (it runs as with the flag)",
                s.name,
            )
        self.handoff = KVHandoff(s, self.c, functools.partial(self.scheduler.meta, worker=s.name), self.hw)
        self.decoding: dict[str, Req] = {}  # past prefill: handing off or decoding (abortable)
        self.tasks: dict[str, asyncio.Task] = {}  # the request path's task of each request
        self.started = time.time()
        self.ready = False

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.open()
        await self.tier.open()
        await self.handoff.open()
        if self.s.mode in ("prefill", "colocated"):
            self.scheduler.run()
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        for t in list(self.tasks.values()):
            t.cancel()
        self.scheduler.stop()
        await self.handoff.close()
        self.publisher.close()
        await self.tier.close()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (by rid) or all: queued/prefilling ones fail with ``Aborted``,
        decoding or hand-off-waiting ones have their task cancelled."""
        n = self.scheduler.abort(rid, abort_all)
        for r in list(self.decoding.values()):
            if (abort_all or r.rid == rid) and not r.aborted:
                r.aborted = True
                t = self.tasks.get(r.rid)
                if t is not None:
                    t.cancel()
                n += 1
        self.c.aborted += n
        return n
