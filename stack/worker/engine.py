"""The emulated engine: a chunked-prefill scheduler over a real prefix cache, a global tier in
Mooncake, the PD hand-off over the TransferEngine, and a decode loop.

Time: every modelled GPU second takes ``time_factor`` real seconds on the modelled clock
(:mod:`stack.worker.clock`): steps end at deadlines, so the emulator's own host work overlaps
the modelled compute instead of adding to it, and a worker that falls behind its clock warns.
Real I/O (Mooncake store reads/writes, TransferEngine writes) takes the time it takes and
counts in TTFT.

Prefill of one request (prefill and colocated modes):
1. queued FIFO; admitted into the running batch while the step's token budget
   (``chunk_tokens``) is not yet filled;
2. on admission: longest local prefix match (capped so the last token is computed, as SGLang
   does) -> pages held; then the next pages present in the global tier (Mooncake) are read
   back (real ``get`` + modelled link time), inserted into the local cache, and held;
3. each step computes up to ``chunk_tokens`` new tokens across running requests, FIFO, taking
   ``c_fwd + sum chunk(n_i, end_i)`` modelled seconds; pages completed by a chunk enter the
   cache (KV events) as they complete;
4. when done: pages not yet in the global tier are written there; in PD mode the request's
   whole KV is written into the decode worker's memory through the TransferEngine.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from stack.core.cost_model import Hardware, load_hardware
from stack.kv_tier.hashing import block_hashes
from stack.worker import kvbytes
from stack.worker.cache import PrefixCache, matchable_pages, page_hashes
from stack.worker.clock import ModelClock
from stack.worker.events import KVEventPublisher
from stack.worker.settings import WorkerSettings
from stack.worker.tokenizer import load_tokenizer, output_token

log = logging.getLogger("stack.worker")

EOS_TOKEN_ID = 151_645


class StoreUnavailable(RuntimeError):
    """The global tier is skipped for a while after a failed or timed-out call."""


def _log_store_error(ex: BaseException, op: str, rid: str) -> None:
    if isinstance(ex, StoreUnavailable):
        log.debug("global-tier %s skipped for %s: %s", op, rid, ex)
    elif isinstance(ex, asyncio.TimeoutError | TimeoutError):
        log.warning("global-tier %s timed out for %s", op, rid)
    else:
        log.warning("global-tier %s failed for %s: %s", op, rid, ex)


class Aborted(Exception):
    pass


@dataclass
class GenParams:
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Req:
    rid: str
    tokens: list[int]
    params: GenParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    t_arrive: float = field(default_factory=time.monotonic)
    t_enqueue: float = 0.0  # entered the engine (after parsing and tokenizing)
    t_runnable: float = 0.0  # runnable by the scheduler (queued, or its global-tier fetch done)
    hashes: list[int] = field(default_factory=list)  # engine page hashes (KV events)
    store_keys: list[str] = field(default_factory=list)  # global-tier keys, one per full page
    # prefill progress
    done_tokens: int = 0
    local_pages: int = 0
    global_pages: int = 0
    held: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_prefill_done: float = 0.0
    fetch_s: float = 0.0
    compute_model_s: float = 0.0
    store_write_s: float = 0.0
    store_written_pages: int = 0
    future: asyncio.Future | None = None
    aborted: bool = False

    @property
    def L(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.L - self.done_tokens

    @property
    def pd(self) -> bool:
        return self.bootstrap_room is not None and self.bootstrap_host not in (None, "", "fake")


@dataclass
class Room:
    """PD rendezvous for one ``bootstrap_room`` on the prefill side."""

    registration: asyncio.Future  # decode's {"peer", "addr", "nbytes"}
    result: asyncio.Future  # what the decode side gets back
    created: float = field(default_factory=time.monotonic)


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_local: int = 0
    cached_tokens_global: int = 0
    computed_tokens: int = 0
    store_fetch_pages: int = 0
    store_fetch_bytes: int = 0
    store_fetch_seconds: float = 0.0
    store_write_pages: int = 0
    store_write_bytes: int = 0
    store_errors: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_verified: int = 0
    kv_transfer_mismatch: int = 0
    bootstrap_timeouts: int = 0
    prefill_steps: int = 0
    ttft_sum: float = 0.0  # wall, HTTP arrival to the first token (prefill done / KV received)
    ttft_model_sum: float = 0.0  # modelled (HTTP arrival to the end of the last step)
    host_before_engine_s: float = 0.0  # wall, HTTP arrival to engine entry (parse, tokenize)


class Engine:
    def __init__(self, s: WorkerSettings, hardware: Hardware | None = None):
        self.s = s
        self.hw = hardware or load_hardware(s.hardware)
        self.cost = self.hw.cost
        self.chunk_tokens = int(s.chunk_tokens or self.hw.chunk_tokens)
        cap_tokens = int(s.capacity_tokens or self.hw.hbm_kv_tokens)
        self.publisher = KVEventPublisher(s.kv_events_endpoint, s.kv_events_topic, s.dp_rank)
        self.cache = PrefixCache(
            s.page_size, max(1, cap_tokens // s.page_size), on_event=self.publisher.publish
        )
        self.tokenizer = load_tokenizer(s.tokenizer)
        self.tpot = float(s.decode_tpot_s if s.decode_tpot_s is not None else self.hw.decode_tpot_s)
        self.c = Counters()
        self.clock = ModelClock(s.time_factor, name=s.name)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.fetching: set[str] = set()
        self.decoding: dict[str, Req] = {}
        self.reqs: dict[str, Req] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.rooms: dict[int, Room] = {}
        self.failed_rooms: dict[int, tuple[str, float]] = {}
        self.store = None
        self._store_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._store_down_until = 0.0
        self.transfer = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self.started = time.time()
        self.ready = False

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        s = self.s
        if s.lmcache_url and s.mode in ("prefill", "colocated"):  # kv_tier lmcache: docs/lmcache.md
            from stack.worker.lmcache_tier import LMCacheStore

            self.store = LMCacheStore(s.lmcache_url, s.page_size, s.kv_bytes_per_token)
            self._store_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="store")
        elif s.mooncake_master and s.mode in ("prefill", "colocated"):
            from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

            cfg = StoreConfig(
                master=s.mooncake_master,
                metadata=s.mooncake_metadata,
                local_host=s.host,
                global_segment_bytes=s.store_segment_bytes,
            )
            self.store = await asyncio.to_thread(lambda: MooncakeStore(cfg).connect())
            self._store_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="store")
        if s.mode in ("prefill", "decode") and s.kv_transport != "http":
            try:
                from stack.kv_tier.transfer import KVTransfer

                self.transfer = await asyncio.to_thread(
                    lambda: KVTransfer(s.host, s.transfer_arena_bytes).start()
                )
            except ImportError:
                if s.kv_transport == "mooncake":
                    raise
                log.warning("mooncake not importable: %s worker hands KV off over HTTP", s.mode)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(s.bootstrap_timeout_s + 30, connect=10))
        if s.mode in ("prefill", "colocated"):
            self._loop_task = asyncio.create_task(self._scheduler(), name="prefill-scheduler")
        self.ready = True

    @property
    def scheduler_alive(self) -> bool:
        """Whether the prefill scheduler task runs (never started on a decode worker)."""
        return self._loop_task is not None and not self._loop_task.done()

    async def stop(self) -> None:
        self.ready = False
        for t in list(self.tasks.values()):
            t.cancel()
        if self._loop_task:
            self._loop_task.cancel()
        if self._http:
            await self._http.aclose()
        self.publisher.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        if self._store_pool is not None:
            self._store_pool.shutdown(wait=False, cancel_futures=True)

    # -- requests -------------------------------------------------------------------------------
    def new_req(self, tokens: list[int], params: GenParams, rid: str | None = None, **bootstrap) -> Req:
        rid = rid or uuid.uuid4().hex
        req = Req(rid=rid, tokens=tokens, params=params, **bootstrap)
        req.hashes = page_hashes(tokens, self.s.page_size)
        if self.store is not None:
            req.store_keys = self.store_keys(tokens)
        return req

    def store_keys(self, tokens: list[int]) -> list[str]:
        """Global-tier keys: the router's block hashes (``stack.kv_tier.hashing``), so the router
        can ask the store what it holds (``global_index.MooncakeExistence``'s default key)."""
        keys = [kvbytes.store_key(self.s.store_key_prefix, h) for h in block_hashes(tokens, self.s.page_size)]
        keys_for = getattr(self.store, "keys_for", None)  # LMCache's tier maps keys to tokens
        return keys_for(tokens, keys) if keys_for is not None else keys

    async def prefill(self, req: Req) -> Req:
        """Queue ``req`` for prefill and wait until its KV is computed (``store_write`` next)."""
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
        self.waiting.append(req)
        self._wake.set()
        try:
            await req.future
        finally:
            self._release(req)
        return req

    async def store_write(self, req: Req) -> None:
        if self.store is not None:
            await self._store_write(req)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (by rid) or all: queued/prefilling ones fail with ``Aborted``,
        decoding or hand-off-waiting ones have their task cancelled."""
        n = 0
        for r in list(self.reqs.values()):
            if abort_all or r.rid == rid:
                r.aborted = True
                if r.future is not None and not r.future.done():
                    r.future.set_exception(Aborted(r.rid))
                n += 1
        for r in list(self.decoding.values()):
            if (abort_all or r.rid == rid) and not r.aborted:
                r.aborted = True
                t = self.tasks.get(r.rid)
                if t is not None:
                    t.cancel()
                n += 1
        self.c.aborted += n
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

    # -- scheduler ------------------------------------------------------------------------------
    async def _scheduler(self) -> None:
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
        batch: list[tuple[Req, int, int]] = []
        budget = self.chunk_tokens
        for r in self.running:
            if budget <= 0:
                break
            take = min(r.remaining, budget)
            if take > 0:
                batch.append((r, take, r.done_tokens + take))
                budget -= take
        if not batch:
            if self.waiting:
                return
            self._wake.clear()
            await self._wake.wait()
            return
        step_s = self.cost.c_fwd + sum(self.cost.chunk(n, end) for _, n, end in batch)
        now = time.monotonic()
        deadline = self.clock.step(step_s, min(r.t_runnable for r, _, _ in batch), now)
        await asyncio.sleep(max(0.0, deadline - now))
        self.c.prefill_steps += 1
        for r, n, end in batch:
            if r.aborted:
                continue
            r.compute_model_s += step_s * n / max(1, sum(b[1] for b in batch))
            self.c.computed_tokens += n
            before_pages = r.done_tokens // self.s.page_size
            r.done_tokens = end
            after_pages = min(len(r.hashes), end // self.s.page_size)
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

    async def _admit(self, req: Req) -> None:
        ps = self.s.page_size
        req.t_admit = time.monotonic()
        limit = matchable_pages(req.L, ps)
        c = self.cache.match(req.hashes, limit)
        if c:
            self.cache.acquire(req.hashes[:c])
            req.held = list(req.hashes[:c])
        req.local_pages = c
        req.done_tokens = c * ps
        if self.store is not None and c < limit:
            self.fetching.add(req.rid)
            asyncio.create_task(self._fetch_then_run(req, c, limit))
        else:
            self.running.append(req)

    async def _fetch_then_run(self, req: Req, c: int, limit: int) -> None:
        assert self._wake is not None
        ps = self.s.page_size
        t0 = time.monotonic()
        try:
            keys = req.store_keys[c:limit]
            exist = await self._store_call(self.store.batch_is_exist, keys)
            g = 0
            while g < len(exist) and exist[g]:
                g += 1
            if g:
                vals = await self._store_call(self.store.get_many, keys[:g])
                pb = ps * self.s.kv_bytes_per_token
                ok = 0
                for k, v in enumerate(vals):  # verify what came back; stop at the first bad page
                    if v is None or v != kvbytes.page_bytes(req.hashes[c + k], pb):
                        break
                    ok += 1
                g = ok
                self.c.store_fetch_bytes += ok * pb
                if g and self.s.model_fetch_time:
                    link = self.hw.link_tokens_per_s(self.s.shared_nic)
                    await asyncio.sleep(g * ps / link * self.s.time_factor)
            if g and not req.aborted:
                got = self.cache.insert(req.hashes[: c + g], req.tokens, c)
                req.held.extend(got)
                req.global_pages = g
                req.done_tokens = (c + g) * ps
                self.c.store_fetch_pages += g
        except Exception as ex:
            self.c.store_errors += 1
            _log_store_error(ex, "fetch", req.rid)
        finally:
            req.fetch_s = time.monotonic() - t0
            self.c.store_fetch_seconds += req.fetch_s
            self.fetching.discard(req.rid)
            if not req.aborted:
                req.t_runnable = time.monotonic()
                self.running.append(req)
            self._wake.set()

    async def _store_call(self, fn, *args):
        """One global-tier call on the store's own threads, bounded by ``store_timeout_s``. After a
        failure the store is skipped (a miss, no write) for ``store_retry_s``, as HiCache's
        storage backend degrades to the local tiers when its store is gone."""
        if time.monotonic() < self._store_down_until:
            raise StoreUnavailable("global tier skipped after a recent failure")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._store_pool, fn, *args), self.s.store_timeout_s
            )
        except Exception:
            self._store_down_until = time.monotonic() + self.s.store_retry_s
            raise

    async def _store_write(self, req: Req) -> None:
        """Write the request's newly computed full pages that the global tier lacks
        (content-addressed). Its hit pages are skipped: fetched from the tier, or computed here
        before and written then (HiCache's write-through of new pages)."""
        t0 = time.monotonic()
        pb = self.s.page_size * self.s.kv_bytes_per_token
        skip = req.local_pages + req.global_pages
        keys = req.store_keys[skip:]
        vals = [kvbytes.page_bytes(h, pb) for h in req.hashes[skip : len(req.store_keys)]]
        try:
            n = await self._store_call(self.store.put_many, keys, vals)
            req.store_written_pages = n
            self.c.store_write_pages += n
            self.c.store_write_bytes += n * pb
        except Exception as ex:
            self.c.store_errors += 1
            _log_store_error(ex, "write", req.rid)
        req.store_write_s = time.monotonic() - t0

    # -- accounting -------------------------------------------------------------------------------
    def account_hits(self, req: Req) -> None:
        ps = self.s.page_size
        self.c.cached_tokens_local += req.local_pages * ps
        self.c.cached_tokens_global += req.global_pages * ps
        self.c.cached_tokens += (req.local_pages + req.global_pages) * ps

    def kv_bytes_task(self, req: Req) -> asyncio.Future:
        """The request's KV bytes (MBs for a long prompt), built on a thread while its prefill
        is modelled: host work beside the modelled GPU time, not after it."""
        return asyncio.ensure_future(asyncio.to_thread(self.kv_of, req))

    def kv_of(self, req: Req) -> bytes:
        return kvbytes.request_kv(req.tokens, req.hashes, self.s.page_size, self.s.kv_bytes_per_token)

    # -- PD: prefill side ---------------------------------------------------------------------------
    def room(self, room_id: int) -> Room:
        r = self.rooms.get(room_id)
        if r is None:
            loop = asyncio.get_running_loop()
            r = Room(loop.create_future(), loop.create_future())
            self.rooms[room_id] = r
        return r

    async def send_kv(self, req: Req, kv: asyncio.Future | None = None) -> dict:
        """Prefill side, after prefill: wait for the decode twin's registration, then write the
        request's KV into its memory through the TransferEngine. ``kv``: the KV bytes, built
        beside the modelled compute (``kv_bytes_task``)."""
        assert req.bootstrap_room is not None
        room = self.room(req.bootstrap_room)
        try:
            reg = await asyncio.wait_for(asyncio.shield(room.registration), self.s.bootstrap_timeout_s)
        except asyncio.TimeoutError:
            self.c.bootstrap_timeouts += 1
            self.rooms.pop(req.bootstrap_room, None)
            raise
        data = await (kv if kv is not None else asyncio.to_thread(self.kv_of, req))
        dg = kvbytes.digest(data)
        t0 = time.monotonic()
        info: dict[str, Any] = {"kv_bytes": len(data), "kv_digest": dg, "peer": reg.get("peer")}
        try:
            if reg.get("peer") is None or self.transfer is None:
                # fallback hand-off (no TransferEngine on one side): the bytes ride in the
                # bootstrap response
                import base64

                info["kv_b64"] = base64.b64encode(data).decode()
                info["transport"] = "http"
            else:
                if int(reg["nbytes"]) != len(data):
                    raise RuntimeError(f"decode reserved {reg['nbytes']} bytes, KV is {len(data)}")
                await asyncio.to_thread(self.transfer.write, reg["peer"], int(reg["addr"]), data)
                info["transport"] = "mooncake"
            info["transfer_s"] = time.monotonic() - t0
            self.c.kv_transfer_bytes_sent += len(data)
            self.c.kv_transfer_seconds += info["transfer_s"]
            info["ok"] = True
        except Exception as e:
            info.update(ok=False, error=str(e))
        info.update(self.prefill_meta(req))
        if not room.result.done():
            room.result.set_result(info)
        self.rooms.pop(req.bootstrap_room, None)
        return {k: v for k, v in info.items() if k != "kv_b64"}

    def prefill_meta(self, req: Req) -> dict:
        ps = self.s.page_size
        return {
            "cached_tokens": (req.local_pages + req.global_pages) * ps,
            "cached_tokens_local": req.local_pages * ps,
            "cached_tokens_global": req.global_pages * ps,
            "prefill_worker": self.s.name,
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

    def fail_room(self, room_id: int | None, error: str) -> None:
        """The prefill half failed or was aborted: tell a waiting decode twin at once."""
        if room_id is None:
            return
        room = self.rooms.pop(room_id, None)
        if room is not None and room.registration.done():
            if not room.result.done():
                room.result.set_result({"ok": False, "error": error})
            return
        # the twin has not registered yet: remember the failure for a while
        now = time.monotonic()
        self.failed_rooms[room_id] = (error, now)
        for k, (_, t) in list(self.failed_rooms.items()):
            if now - t > self.s.bootstrap_timeout_s:
                del self.failed_rooms[k]

    async def register_decode(self, room_id: int, peer: str, addr: int, nbytes: int) -> dict:
        """Bootstrap endpoint (prefill side): the decode twin registers its receive region and
        waits until the prefill has written the KV there."""
        failed = self.failed_rooms.pop(room_id, None)
        if failed is not None:
            return {"ok": False, "error": failed[0]}
        room = self.room(room_id)
        if not room.registration.done():
            room.registration.set_result({"peer": peer, "addr": addr, "nbytes": nbytes})
        try:
            return await asyncio.wait_for(asyncio.shield(room.result), self.s.bootstrap_timeout_s)
        except asyncio.TimeoutError:
            self.c.bootstrap_timeouts += 1
            self.rooms.pop(room_id, None)
            return {"ok": False, "error": "timed out waiting for the prefill twin"}

    # -- PD: decode side -----------------------------------------------------------------------------
    async def receive_kv(self, req: Req) -> dict:
        """Decode side: reserve a region, register with the prefill's bootstrap server, wait for
        the bytes, check them against the KV recomputed from the prompt tokens."""
        assert self._http is not None
        expected = await asyncio.to_thread(self.kv_of, req)
        n = len(expected)
        te = self.transfer
        addr = te.reserve(n) if te is not None else 0
        t0 = time.monotonic()
        try:
            url = f"http://{req.bootstrap_host}:{req.bootstrap_port}/kv/register"
            r = await self._http.post(
                url,
                json={
                    "room": req.bootstrap_room,
                    "peer": te.peer if te is not None else None,
                    "addr": addr,
                    "nbytes": n,
                    "rid": req.rid,
                },
            )
            r.raise_for_status()
            info = r.json()
            if not info.get("ok"):
                raise RuntimeError(f"prefill side failed: {info.get('error')}")
            b64 = info.pop("kv_b64", None)
            if b64 is not None:
                import base64

                data = base64.b64decode(b64)
            else:
                assert te is not None
                data = te.read(addr, n)
        finally:
            if te is not None:
                te.free(addr, n)
        got = kvbytes.digest(data)
        info["kv_received_digest"] = got
        info["kv_verified"] = data == expected and got == info.get("kv_digest")
        info["wait_s"] = time.monotonic() - t0
        self.c.kv_transfer_bytes_received += n
        if info["kv_verified"]:
            self.c.kv_transfer_verified += 1
        else:
            self.c.kv_transfer_mismatch += 1
        return info

    # -- output -------------------------------------------------------------------------------------
    def plan_output(self, req: Req) -> tuple[list[tuple[int, str]], dict]:
        """The deterministic output (token id, text piece) list and its finish_reason."""
        p = req.params
        seed = req.hashes[-1] if req.hashes else hash(tuple(req.tokens)) & 0xFFFFFFFF
        seed ^= len(req.tokens)
        natural = 8 + (seed & 0xFFFF) % max(1, self.s.max_natural_tokens - 7)
        if p.ignore_eos:
            n = p.max_new_tokens if p.max_new_tokens is not None else natural
        else:
            n = natural if p.max_new_tokens is None else min(p.max_new_tokens, natural)
        out: list[tuple[int, str]] = []
        text = ""
        for i in range(n):
            tid, piece = output_token(seed, i)
            new_text = text + piece
            for st in p.stop:
                if st and st in new_text:
                    keep = new_text[: new_text.index(st)][len(text) :]
                    out.append((tid, keep))
                    return out, {"type": "stop", "matched": st}
            out.append((tid, piece))
            text = new_text
        if p.max_new_tokens is not None and n >= p.max_new_tokens:
            return out, {"type": "length", "length": n}
        return out, {"type": "stop", "matched": EOS_TOKEN_ID}

    async def pace_tokens(self, n: int):
        """Yield token indices paced at the decode TPOT (scaled), on deadlines (token i is due
        ``(i + 1) * TPOT`` after the first), so the host work of streaming does not add to it."""
        per = self.tpot * self.s.time_factor
        t0 = time.monotonic()
        for i in range(n):
            yield i
            wait = t0 + (i + 1) * per - time.monotonic()
            if wait >= 0.002:
                await asyncio.sleep(wait)

    # -- load ---------------------------------------------------------------------------------------
    def queued_prefill_model_s(self) -> float:
        """Modelled seconds of prefill work queued or running (unscaled)."""
        tot = 0.0
        for r in list(self.running) + list(self.waiting):
            tot += self.cost.cost(max(0, r.remaining), r.L)
        return tot

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
