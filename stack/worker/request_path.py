"""The engine-facing request path every HTTP shape shares: one ``Req`` in, a stream of tokens out.

The HTTP layer (``stack.worker.http``) parses a body into a ``Req`` and turns the items
:meth:`Worker.execute` yields into SGLang, OpenAI (or, later, other API) bodies; everything
that drives the engine's parts (:class:`~stack.worker.engine.Engine`: its scheduler, global
tier and PD hand-off) lives here, so a new API shape or a new serving mode never has to repeat
the prefill / PD hand-off / decode sequence.

PD: a request carrying ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` is one half of
a PD pair. The prefill half prefills, writes the KV to the decode half through the
TransferEngine and answers with its first token; the decode half registers a receive region
with the prefill's bootstrap server, waits for the bytes, verifies them and generates.
Without bootstrap fields a prefill (or colocated) worker serves the request alone, and a decode
worker generates without KV (like SGLang's ``fake`` transfer backend).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from stack.worker import output
from stack.worker.cache import page_hashes
from stack.worker.engine import Aborted, Engine, GenParams, Req
from stack.worker.latency import Latency
from stack.worker.settings import WorkerSettings
from stack.worker.timing import ModelTimeline, metrics_meta

log = logging.getLogger("stack.worker")

_NO_HITS = {"cached_tokens": 0, "cached_tokens_local": 0, "cached_tokens_global": 0}


def aborted_meta(req: Req, message: str, status_code: int | None = None) -> dict[str, Any]:
    """The ``done`` meta of a request that ended without output (SGLang answers an abort).
    ``status_code``: a failure's (SGLang 0.5.23 sets 500 when a PD hand-off fails, e.g. the
    decode half's bootstrap timeout); None: a graceful abort (the client's, ``/abort_request``).
    OpenAI-shaped answers turn a failure into an error
    (:func:`stack.worker.http.relay.failure`)."""
    return {
        "id": req.rid,
        "finish_reason": {"type": "abort", "message": message, "status_code": status_code, "err_type": None},
        "prompt_tokens": req.L,
        "completion_tokens": 0,
        "cached_tokens": 0,
    }


class Worker:
    """One emulated worker: its settings and engine, and the request path on top of them."""

    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.engine = Engine(settings)
        self.latency = Latency()  # TTFT and TPOT histograms (/metrics)
        #: --enable-metrics timestamps: the modelled timeline (stack/worker/timing.py)
        self.timeline = ModelTimeline(settings.time_factor)

    def make_req(
        self,
        tokens: list[int],
        params: GenParams,
        *,
        rid: str | None = None,
        t_arrive: float | None = None,
        **bootstrap: Any,
    ) -> Req:
        """``t_arrive``: when the HTTP request was received (TTFT counts parsing and tokenizing);
        ``bootstrap``: the PD fields (``stack.worker.http.parse.bootstrap_fields``)."""
        req = Req(rid=rid or uuid.uuid4().hex, tokens=tokens, params=params, **bootstrap)
        req.hashes = page_hashes(tokens, self.s.page_size)
        tier = self.engine.tier
        if tier.store is not None:
            req.store_keys = tier.keys(tokens)
        if t_arrive is not None:
            req.t_arrive = t_arrive
        return req

    def hands_off(self, req: Req) -> bool:
        """Whether ``req`` is the prefill half of a PD pair (it answers with one token only)."""
        return self.s.mode == "prefill" and req.pd

    # -- the request path, shared by every endpoint --------------------------------------------
    async def execute(self, req: Req) -> AsyncIterator[dict]:
        """Yields ``{"token": id, "text": piece}`` items and finally ``{"done": meta}``."""
        e = self.engine
        task = asyncio.current_task()
        if task is not None:
            e.tasks[req.rid] = task
        try:
            info = await (self._obtain_kv(req) if self.s.mode == "decode" else self._compute_kv(req))
            ttft = time.monotonic() - req.t_arrive
            e.c.ttft_sum += ttft
            e.c.ttft_model_sum += float(info.get("ttft_model_s") or 0.0)
            if req.t_enqueue:
                e.c.host_before_engine_s += req.t_enqueue - req.t_arrive
            plan, finish = output.plan_output(req, self.s.max_natural_tokens)
            if self.hands_off(req):
                plan, finish = plan[:1], {"type": "length", "length": 1}
            n = 0
            if plan:
                async for i in output.pace_tokens(len(plan), e.tpot * self.s.time_factor):
                    tid, piece = plan[i]
                    n += 1
                    yield {"token": tid, "text": piece}
            e.c.generation_tokens += n
            e.c.finished += 1
            meta = self._finished_meta(req, finish, n, info, ttft)
            self.latency.finished(ttft, meta["e2e_latency"], n)
            yield {"done": meta}
        except (asyncio.CancelledError, Aborted):  # counted in Engine.abort
            self._fail_room(req, "prefill request aborted")
            yield {"done": aborted_meta(req, "aborted")}
        except Exception as ex:  # a failed hand-off or twin timeout: SGLang answers an abort too
            log.warning("request %s failed: %s: %s", req.rid, type(ex).__name__, ex)
            self._fail_room(req, f"prefill failed: {ex}")
            yield {"done": aborted_meta(req, str(ex), 500)}
        finally:
            e.tasks.pop(req.rid, None)
            e.decoding.pop(req.rid, None)

    async def _obtain_kv(self, req: Req) -> dict[str, Any]:
        """Decode side: receive the KV from the prefill twin (PD) or start without it."""
        e = self.engine
        req.t_enqueue = time.monotonic()
        e.decoding[req.rid] = req
        e.c.requests += 1
        e.c.prompt_tokens += req.L
        if not req.pd:
            return dict(_NO_HITS)
        info = await e.handoff.receive_kv(req)
        info.pop("ok", None)
        return info

    async def _compute_kv(self, req: Req) -> dict[str, Any]:
        """Prefill / colocated side: prefill, write the global tier and, as a PD prefill half,
        send the KV to the decode twin (both at once)."""
        e = self.engine
        kv = e.handoff.kv_bytes_task(req) if self.hands_off(req) else None
        try:
            await e.scheduler.prefill(req)
        except BaseException:
            if kv is not None:
                kv.cancel()
            raise
        e.scheduler.account_hits(req)
        e.decoding[req.rid] = req  # abortable while it hands off / decodes
        if kv is not None and e.hw.handoff.between_forwards:
            await e.scheduler.pass_end(req)
        if kv is None:
            await e.tier.write(req)
            return e.scheduler.meta(req, self.s.name)
        _, sent = await asyncio.gather(e.tier.write(req), e.handoff.send_kv(req, kv))
        info = dict(sent)
        if not sent.get("ok"):
            raise RuntimeError(f"KV transfer failed: {sent.get('error')}")
        info.pop("ok", None)
        return info

    def _fail_room(self, req: Req, error: str) -> None:
        """A prefill half that failed tells its waiting decode twin at once."""
        if self.hands_off(req):
            self.engine.handoff.fail_room(req.bootstrap_room, error)

    def _finished_meta(
        self, req: Req, finish: dict, n: int, info: dict[str, Any], ttft: float
    ) -> dict[str, Any]:
        """SGLang's ``meta_info`` (``cached_tokens`` is local + global) plus the emulator's split
        of the hits and its timings."""
        meta = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": req.L,
            "completion_tokens": n,
            "cached_tokens": int(info.get("cached_tokens", 0)),
            "cached_tokens_local": int(info.get("cached_tokens_local", 0)),
            "cached_tokens_global": int(info.get("cached_tokens_global", 0)),
            "e2e_latency": time.monotonic() - req.t_arrive,
            "ttft": ttft,
            "emulator": {"worker": self.s.name, "mode": self.s.mode, **info},
        }
        if self.s.enable_metrics:  # SGLang's --enable-metrics fields, on the modelled clock
            meta.update(metrics_meta(req, self.timeline, self.s.mode != "decode"))
        return meta
