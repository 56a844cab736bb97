"""The emulated engine: a composition of a chunked-prefill scheduler over a real prefix cache
(:mod:`stack.worker.scheduler`), a global tier in Mooncake (:mod:`stack.worker.global_tier`),
the PD hand-off over the TransferEngine (:mod:`stack.worker.pd_handoff`) and a paced decode
output (:mod:`stack.worker.output`). The request path (:mod:`stack.worker.request_path`) and the
HTTP layer talk to :class:`Engine` only.

Time: every modelled GPU second takes ``time_factor`` real seconds on the modelled clock
(:mod:`stack.worker.clock`): steps end at deadlines, so the emulator's own host work overlaps
the modelled compute instead of adding to it, and a worker that falls behind its clock warns.
Real I/O (Mooncake store reads/writes, TransferEngine writes) takes the time it takes and
counts in TTFT.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from stack.core.cost_model import Hardware, load_hardware
from stack.worker import output
from stack.worker.cache import PrefixCache, page_hashes
from stack.worker.clock import ModelClock
from stack.worker.events import KVEventPublisher
from stack.worker.global_tier import GlobalTier
from stack.worker.pd_handoff import KVHandoff, Room
from stack.worker.request import Aborted, Counters, GenParams, Req
from stack.worker.scheduler import PrefillScheduler
from stack.worker.settings import WorkerSettings
from stack.worker.tokenizer import load_tokenizer

# the request types callers import from here
__all__ = ["Aborted", "Engine", "GenParams", "Req"]

log = logging.getLogger("stack.worker")


class Engine:
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
        self.handoff = KVHandoff(s, self.c, self.prefill_meta)
        self.decoding: dict[str, Req] = {}  # past prefill: handing off or decoding (abortable)
        self.tasks: dict[str, asyncio.Task] = {}  # the request path's task of each request
        self.started = time.time()
        self.ready = False

    # -- the parts' state, as callers read it -----------------------------------------------------
    @property
    def waiting(self) -> collections.deque[Req]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Req]:
        return self.scheduler.running

    @property
    def fetching(self) -> set[str]:
        return self.scheduler.fetching

    @property
    def reqs(self) -> dict[str, Req]:
        return self.scheduler.reqs

    @property
    def store(self) -> Any:
        return self.tier.store

    @property
    def transfer(self) -> Any:
        return self.handoff.transfer

    @property
    def rooms(self) -> dict[int, Room]:
        return self.handoff.rooms

    @property
    def failed_rooms(self) -> dict[int, tuple[str, float]]:
        return self.handoff.failed_rooms

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.open()
        await self.tier.open()
        await self.handoff.open()
        if self.s.mode in ("prefill", "colocated"):
            self.scheduler.run()
        self.ready = True

    @property
    def scheduler_alive(self) -> bool:
        """Whether the prefill scheduler task runs (never started on a decode worker)."""
        return self.scheduler.alive

    async def stop(self) -> None:
        self.ready = False
        for t in list(self.tasks.values()):
            t.cancel()
        self.scheduler.stop()
        await self.handoff.close()
        self.publisher.close()
        await self.tier.close()

    # -- requests -------------------------------------------------------------------------------
    def new_req(self, tokens: list[int], params: GenParams, rid: str | None = None, **bootstrap) -> Req:
        rid = rid or uuid.uuid4().hex
        req = Req(rid=rid, tokens=tokens, params=params, **bootstrap)
        req.hashes = page_hashes(tokens, self.s.page_size)
        if self.store is not None:
            req.store_keys = self.store_keys(tokens)
        return req

    def store_keys(self, tokens: list[int]) -> list[str]:
        """Global-tier keys of ``tokens``' full pages (``GlobalTier.keys``)."""
        return self.tier.keys(tokens)

    async def prefill(self, req: Req) -> Req:
        """Queue ``req`` for prefill and wait until its KV is computed (``store_write`` next)."""
        return await self.scheduler.prefill(req)

    async def store_write(self, req: Req) -> None:
        await self.tier.write(req)

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

    # -- accounting -------------------------------------------------------------------------------
    def account_hits(self, req: Req) -> None:
        self.scheduler.account_hits(req)

    def prefill_meta(self, req: Req) -> dict:
        return self.scheduler.meta(req, self.s.name)

    # -- PD hand-off ------------------------------------------------------------------------------
    def kv_bytes_task(self, req: Req) -> asyncio.Future:
        return self.handoff.kv_bytes_task(req)

    def kv_of(self, req: Req) -> bytes:
        return self.handoff.kv_of(req)

    def room(self, room_id: int) -> Room:
        return self.handoff.room(room_id)

    async def send_kv(self, req: Req, kv: asyncio.Future | None = None) -> dict:
        return await self.handoff.send_kv(req, kv)

    def fail_room(self, room_id: int | None, error: str) -> None:
        self.handoff.fail_room(room_id, error)

    async def register_decode(self, room_id: int, peer: str, addr: int, nbytes: int) -> dict:
        return await self.handoff.register_decode(room_id, peer, addr, nbytes)

    async def receive_kv(self, req: Req) -> dict:
        return await self.handoff.receive_kv(req)

    # -- output -------------------------------------------------------------------------------------
    def plan_output(self, req: Req) -> tuple[list[tuple[int, str]], dict]:
        """The deterministic output (token id, text piece) list and its finish_reason."""
        return output.plan_output(req, self.s.max_natural_tokens)

    def pace_tokens(self, n: int) -> AsyncIterator[int]:
        """Token indices paced at the decode TPOT (scaled), on deadlines."""
        return output.pace_tokens(n, self.tpot * self.s.time_factor)

    # -- load ---------------------------------------------------------------------------------------
    def queued_prefill_model_s(self) -> float:
        """Modelled seconds of prefill work queued or running (unscaled)."""
        return self.scheduler.queued_model_s()

    def loads(self) -> dict:
        waiting_uncached = sum(r.remaining for r in self.waiting)
        running = len(self.running) + len(self.fetching) + len(self.decoding)
        used = self.cache.used_tokens
        cap = self.cache.capacity_pages * self.s.page_size
        c = self.c
        hit = c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        return {
            "dp_rank": self.s.dp_rank,
            "num_running_reqs": running,
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": waiting_uncached,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_uncached,
            "max_total_num_tokens": cap,
            "token_usage": round(used / cap, 4) if cap else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": round(hit, 4),
            "utilization": 1.0 if running else 0.0,
            "max_running_requests": 1024,
            "num_total_reqs": running + len(self.waiting),
            "queued_prefill_s": round(self.queued_prefill_model_s(), 6),
        }
