"""The PD hand-off of the emulated engine: a prefill half writes a request's whole KV into its
decode twin's memory through Mooncake's TransferEngine (:mod:`stack.kv_tier.transfer`), or,
when either side has no TransferEngine, sends the bytes back in the bootstrap response.

Prefill side: the decode twin registers its receive region for a ``bootstrap_room`` on the
prefill's bootstrap server (:meth:`KVHandoff.register_decode`) and waits; once its prefill is
done the prefill half writes the KV there (:meth:`KVHandoff.send_kv`) and answers the wait.
Decode side: :meth:`KVHandoff.receive_kv` reserves the region, registers, waits and checks the
bytes against the KV recomputed from the prompt tokens (:mod:`stack.worker.kvbytes`), then
waits the calibration's modelled hand-off on the engines (:class:`~stack.core.cost_model.HandoffCost`, all of it but
the HTTP hops, which are real here; 0 in the shipped GPU calibrations).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from stack.core.cost_model import Hardware
from stack.worker import kvbytes
from stack.worker.request import Counters, Req
from stack.worker.settings import WorkerSettings

log = logging.getLogger("stack.worker")


@dataclass
class Room:
    """PD rendezvous for one ``bootstrap_room`` on the prefill side."""

    registration: asyncio.Future  # decode's {"peer", "addr", "nbytes"}
    result: asyncio.Future  # what the decode side gets back
    created: float = field(default_factory=time.monotonic)


class KVHandoff:
    """Both halves of the hand-off. ``prefill_meta``: the prefill's hits and timings, sent to
    the decode twin with the KV; ``hw``: the calibration whose ``handoff`` terms the decode side
    waits."""

    def __init__(
        self,
        s: WorkerSettings,
        counters: Counters,
        prefill_meta: Callable[[Req], dict],
        hw: Hardware | None = None,
    ):
        self.s = s
        self.hw = hw
        self.c = counters
        self.prefill_meta = prefill_meta
        self.rooms: dict[int, Room] = {}
        self.failed_rooms: dict[int, tuple[str, float]] = {}
        self.transfer: Any = None
        self._http: httpx.AsyncClient | None = None

    # -- life cycle -----------------------------------------------------------------------------
    async def open(self) -> None:
        """The TransferEngine (PD halves, unless ``kv_transport`` is http) and the client the
        decode side registers with."""
        s = self.s
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

    async def close(self) -> None:
        if self._http:
            await self._http.aclose()

    # -- KV bytes -------------------------------------------------------------------------------
    def kv_of(self, req: Req) -> bytes:
        return kvbytes.request_kv(req.tokens, req.hashes, self.s.page_size, self.s.kv_bytes_per_token)

    def kv_bytes_task(self, req: Req) -> asyncio.Future:
        """The request's KV bytes (MBs for a long prompt), built on a thread while its prefill
        is modelled: host work beside the modelled GPU time, not after it."""
        return asyncio.ensure_future(asyncio.to_thread(self.kv_of, req))

    # -- prefill side ---------------------------------------------------------------------------
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

    # -- decode side ----------------------------------------------------------------------------
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
        hw = self.hw
        if hw is not None and not hw.handoff.off:
            model_s = hw.handoff.engine_seconds(req.L, hw.kv_bytes_per_token, hw.decode)
            info["handoff_model_s"] = model_s
            await asyncio.sleep(model_s * self.s.time_factor)
        self.c.kv_transfer_bytes_received += n
        if info["kv_verified"]:
            self.c.kv_transfer_verified += 1
        else:
            self.c.kv_transfer_mismatch += 1
        return info
