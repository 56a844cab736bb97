"""The prefill scheduler: chunked prefill over the real prefix cache on the modelled clock.

Prefill of one request (prefill and colocated modes):
1. queued FIFO, or with SGLang's ``--enable-priority-scheduling`` by the request's
   ``priority`` (highest first, lowest with ``--schedule-low-priority-values-first``; none:
   after every prioritised one) then arrival, as SGLang 0.5.23 sorts its waiting queue;
   admitted into the running batch while the step's token budget (``chunk_tokens``) is not
   yet filled. Never preempted once admitted: SGLang with ``--disable-priority-preemption``
   (without it SGLang may preempt only when its running batch is full, which the emulator
   does not model; it runs as with the flag and says so at start);
2. on admission: longest local prefix match (capped so the last token is computed, as SGLang
   does) -> pages held; then the next pages present in the global tier
   (:mod:`stack.worker.global_tier`) are read back, inserted into the local cache, and held;
3. each step computes up to ``chunk_tokens`` new tokens across running requests, FIFO, taking
   ``c_fwd + sum chunk(n_i, end_i)`` modelled seconds and ending at its deadline on the
   modelled clock (:mod:`stack.worker.clock`); pages completed by a chunk enter the cache (KV
   events) as they complete;
4. when done, the request's future resolves (the global-tier write and the PD hand-off follow
   in the request path).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time

from stack.core.cost_model import CostModel
from stack.worker.cache import PrefixCache, matchable_pages
from stack.worker.clock import ModelClock
from stack.worker.global_tier import GlobalTier
from stack.worker.request import Aborted, Counters, Req

log = logging.getLogger("stack.worker")

#: one chunk of a step: the request, the tokens it computes, its computed length after the step
Chunk = tuple[Req, int, int]


def take_chunks(running: list[Req], budget: int) -> list[Chunk]:
    """One step's batch: the running requests' next chunks, FIFO, until ``budget`` tokens."""
    batch: list[Chunk] = []
    for r in running:
        if budget <= 0:
            break
        take = min(r.remaining, budget)
        if take > 0:
            batch.append((r, take, r.done_tokens + take))
            budget -= take
    return batch


class PrefillScheduler:
    """The waiting queue, the running batch and the loop that steps it."""

    def __init__(
        self,
        page_size: int,
        chunk_tokens: int,
        cost: CostModel,
        cache: PrefixCache,
        clock: ModelClock,
        tier: GlobalTier,
        counters: Counters,
        priority_scheduling: bool = False,
        low_priority_first: bool = False,
    ):
        self.page_size = page_size
        self.chunk_tokens = chunk_tokens
        self.cost = cost
        self.cache = cache
        self.clock = clock
        self.tier = tier
        self.c = counters
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.fetching: set[str] = set()
        self.reqs: dict[str, Req] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        #: the forward in flight: its result is its end, on the modelled clock (None: idle)
        self._forward: asyncio.Future[float] | None = None
        #: priority scheduling: the sign the priority is sorted by (None: FIFO); a request
        #: without one gets SGLang's default, the lowest
        self.prio_sign: int | None = (1 if low_priority_first else -1) if priority_scheduling else None
        self.prio_default = sys.maxsize if low_priority_first else -sys.maxsize - 1

    # -- life cycle -----------------------------------------------------------------------------
    def open(self) -> None:
        """Ready to queue requests (the loop itself starts with :meth:`run`)."""
        self._wake = asyncio.Event()

    def run(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="prefill-scheduler")

    @property
    def alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def stop(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()

    # -- requests -------------------------------------------------------------------------------
    async def prefill(self, req: Req) -> Req:
        """Queue ``req`` for prefill and wait until its KV is computed."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        req.future = loop.create_future()
        self.reqs[req.rid] = req
        self.c.requests += 1
        self.c.prompt_tokens += req.L
        req.t_enqueue = time.monotonic()
        # runnable from its HTTP arrival: the emulator's own parsing and tokenizing overlap the
        # modelled compute (as SGLang's tokenizer process runs beside the GPU) instead of adding
        req.t_runnable = min(req.t_arrive, req.t_enqueue)
        if self.prio_sign is None:
            self.waiting.append(req)
        else:
            self._enqueue_by_priority(req)
        self._wake.set()
        try:
            await req.future
        finally:
            self._release(req)
        return req

    def _prio_key(self, req: Req) -> int:
        assert self.prio_sign is not None
        p = self.prio_default if req.priority is None else req.priority
        return p * self.prio_sign

    def _enqueue_by_priority(self, req: Req) -> None:
        """Queue ``req`` after every waiting request of its priority or a higher one: the
        waiting queue stays in (priority, time queued) order, SGLang's
        ``_sort_by_priority_and_fcfs`` kept by insertion."""
        k = self._prio_key(req)
        w = self.waiting
        i = len(w)
        while i and self._prio_key(w[i - 1]) > k:
            i -= 1
        w.insert(i, req)

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """Fail queued or prefilling requests (one by rid, or all) with ``Aborted``."""
        n = 0
        for r in list(self.reqs.values()):
            if abort_all or r.rid == rid:
                r.aborted = True
                if r.future is not None and not r.future.done():
                    r.future.set_exception(Aborted(r.rid))
                n += 1
        return n

    def _release(self, req: Req) -> None:
        self.reqs.pop(req.rid, None)
        if req in self.running:
            self.running.remove(req)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        if req.held:
            self.cache.release(req.held)
            req.held = []

    def queued_model_s(self) -> float:
        """Modelled seconds of prefill work queued or running (unscaled)."""
        tot = 0.0
        for r in list(self.running) + list(self.waiting):
            tot += self.cost.cost(max(0, r.remaining), r.L)
        return tot

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the engine die
                log.exception("prefill step failed")
                await asyncio.sleep(0.01)

    async def _step(self) -> None:
        assert self._wake is not None
        if not self.waiting and not self.running:
            self._wake.clear()
            await self._wake.wait()
            return
        # admit FIFO while the budget is not filled by the running requests' remaining work
        while self.waiting and sum(r.remaining for r in self.running) < self.chunk_tokens:
            req = self.waiting.popleft()
            if req.aborted:
                continue
            await self._admit(req)
        batch = take_chunks(self.running, self.chunk_tokens)
        if not batch:
            if self.waiting:
                return
            self._wake.clear()
            await self._wake.wait()
            return
        step_s = self.cost.c_fwd + sum(self.cost.chunk(n, end) for _, n, end in batch)
        now = time.monotonic()
        deadline = self.clock.step(step_s, min(r.t_runnable for r, _, _ in batch), now)
        start = deadline - step_s * self.clock.time_factor  # the step's start, on the modelled clock
        for r, _, _ in batch:
            if not r.t_forward_entry:
                r.t_forward_entry = start
        fwd = self._forward = asyncio.get_running_loop().create_future()
        try:
            await asyncio.sleep(max(0.0, deadline - now))
            self.c.prefill_steps += 1
            self._complete(batch, step_s, deadline)
        finally:
            self._forward = None
            fwd.set_result(deadline)

    async def pass_end(self, req: Req) -> None:
        """Hand ``req``'s finished prefill over between forwards, as SGLang's PD prefill loop
        does (``handoff.between_forwards``): when a forward is in flight (the loop started it
        as ``req`` finished), wait for its end, and stamp ``req``'s prefill as finished there
        (SGLang stamps ``prefill_finished_time`` when it hands a request over)."""
        fwd = self._forward
        if fwd is not None:
            req.t_prefill_done = max(req.t_prefill_done, await asyncio.shield(fwd))

    def _complete(self, batch: list[Chunk], step_s: float, deadline: float) -> None:
        """Account a finished step: computed tokens, completed pages into the cache, finished
        requests out of the batch (done at ``deadline``, on the modelled clock)."""
        ps = self.page_size
        for r, n, end in batch:
            if r.aborted:
                continue
            r.compute_model_s += step_s * n / max(1, sum(b[1] for b in batch))
            self.c.computed_tokens += n
            before_pages = r.done_tokens // ps
            r.done_tokens = end
            after_pages = min(len(r.hashes), end // ps)
            if after_pages > before_pages and len(r.held) >= before_pages:
                # pages completed by this chunk enter the cache (as SGLang's cache_unfinished_req)
                start = len(r.held)
                if start < after_pages:
                    got = self.cache.insert(r.hashes[:after_pages], r.tokens, start)
                    r.held.extend(got)
            if r.remaining <= 0:
                if r in self.running:  # a cancelled request was released during the step
                    self.running.remove(r)
                r.t_prefill_done = deadline  # on the modelled clock
                if r.future is not None and not r.future.done():
                    r.future.set_result(r)

    # -- admission ------------------------------------------------------------------------------
    async def _admit(self, req: Req) -> None:
        ps = self.page_size
        req.t_admit = time.monotonic()
        limit = matchable_pages(req.L, ps)
        c = self.cache.match(req.hashes, limit)
        if c:
            self.cache.acquire(req.hashes[:c])
            req.held = list(req.hashes[:c])
        req.local_pages = c
        req.done_tokens = c * ps
        if self.tier.store is not None and c < limit:
            self.fetching.add(req.rid)
            asyncio.create_task(self._fetch_then_run(req, c, limit))
        else:
            self.running.append(req)

    async def _fetch_then_run(self, req: Req, c: int, limit: int) -> None:
        """Read the next pages from the global tier into the local cache, then run ``req``."""
        assert self._wake is not None
        t0 = time.monotonic()
        try:
            g = await self.tier.read(req, c, limit)
            if g and not req.aborted:
                got = self.cache.insert(req.hashes[: c + g], req.tokens, c)
                req.held.extend(got)
                req.global_pages = g
                req.done_tokens = (c + g) * self.page_size
                self.c.store_fetch_pages += g
        except Exception as ex:
            self.tier.failed(ex, "fetch", req.rid)
        finally:
            req.fetch_s = time.monotonic() - t0
            self.c.store_fetch_seconds += req.fetch_s
            self.fetching.discard(req.rid)
            if not req.aborted:
                req.t_runnable = time.monotonic()
                self.running.append(req)
            self._wake.set()

    # -- what a prefill cost --------------------------------------------------------------------
    def account_hits(self, req: Req) -> None:
        ps = self.page_size
        self.c.cached_tokens_local += req.local_pages * ps
        self.c.cached_tokens_global += req.global_pages * ps
        self.c.cached_tokens += (req.local_pages + req.global_pages) * ps

    def meta(self, req: Req, worker: str) -> dict:
        """The prefill's hits and timings (``prefill_worker``: ``worker``)."""
        ps = self.page_size
        return {
            "cached_tokens": (req.local_pages + req.global_pages) * ps,
            "cached_tokens_local": req.local_pages * ps,
            "cached_tokens_global": req.global_pages * ps,
            "prefill_worker": worker,
            "queue_s": round(max(0.0, req.t_admit - req.t_arrive), 6),
            "fetch_s": round(req.fetch_s, 6),
            "compute_model_s": round(req.compute_model_s, 6),
            "prefill_s": round(max(0.0, req.t_prefill_done - req.t_arrive), 6),
            # the engine's own modelled TTFT: from the HTTP arrival to the end of its last step
            # on the modelled clock (queueing, real fetch I/O, modelled compute; its parsing and
            # tokenizing overlap the compute)
            "ttft_model_s": round(self.clock.modelled(max(0.0, req.t_prefill_done - req.t_arrive)), 6),
            "store_write_s": round(req.store_write_s, 6),
            "store_written_pages": req.store_written_pages,
        }
