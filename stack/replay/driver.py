"""The async replay driver: the simulator's load model over real HTTP.

Session starts come from ``stack.sim.load.plan`` (seeded Poisson, whole sessions; or the
trace's own clock compressed), exactly as ``smetric sim`` draws them. An agent stream's
first turn is sent at ``start + offset``; every follow-up ``think`` seconds after its
predecessor's answer has been fully received (closed loop). Modelled seconds become wall
seconds times ``time_factor`` (the emulator's factor), so a run is quick.

Each request is a streamed chat completion (``max_tokens`` = the trace's output length,
``ignore_eos``), so TTFT and TPOT are measured on the wire. TTFT ends at the answer's first
chunk (SGLang sends it, with the assistant role, once the first token is made; the emulator
likewise): the engine's first token, what the simulator's TTFT is. The first chunk with
visible text can come later, when the detokenizer holds back a token that is an incomplete
UTF-8 character until the next ones complete it (frequent with a random-weight test model);
that reading is kept beside it (``ttft_text_wall``, the summary's ``ttft_text_*``), as
clients that time the first printed character see it. Every request has a timeout;
errors are counted (a failed turn ends its agent stream); after the last arrival the run
drains in-flight requests for at most ``drain_timeout`` and then cancels them.

With a client model (``ReplayConfig.clients``, the simulator's :class:`~stack.sim.clients.ClientModel`)
each request is sent as the official SDKs send it: an attempt without a first token after the
client's patience is abandoned (its connection closed: the router aborts it), and an overload
answer (408, 409, 429, 5xx, 529), a timeout or a transport error is retried after the answer's
Retry-After or a jittered backoff, up to the model's retries; TTFT counts from the first
attempt. The model's seconds are modelled seconds (times ``time_factor`` on the wire), a
Retry-After header is wall seconds (divided by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import orjson

from stack.core.types import SLO
from stack.replay.builder import Built, Conversations, Vocab, read_block_ids
from stack.replay.metrics import (
    LoadSampler,
    Outcome,
    decisions,
    parse_prometheus,
    prefill_inflight,
    summarize,
)
from stack.replay.tokcheck import Check, check_tokenizer
from stack.sim.clients import ClientModel
from stack.sim.load import LoadSpec, SessionStart, plan, rate_of
from stack.traces.load import load_trace
from stack.traces.model import Trace


@dataclass
class ReplayConfig:
    target: str
    trace: str
    load: LoadSpec
    time_factor: float = 1.0
    max_inflight: int = 256
    request_timeout: float = 120.0  # wall seconds per request
    drain_timeout: float | None = None  # wall seconds after the last arrival (default: request_timeout)
    max_wall: float | None = None  # hard stop (wall seconds); default derived from the load
    slo: SLO = field(default_factory=SLO)
    tokenizer: str | None = None
    model: str | None = None
    api_key: str | None = None
    fmt: str = "auto"
    metrics_url: str | None = None  # default: <target>/metrics ("" disables)
    check_tokenizer: bool = True  # refuse to start when the target counts prompts otherwise
    poll_s: float = 0.25  # wall seconds between /metrics samples
    window_s: float = 30.0  # modelled seconds per imbalance window
    transport: object | None = None  # an httpx async transport (benchmarks/replicas.py spreads over replicas)
    clients: ClientModel | None = None  # clients that time out and retry (None: one attempt each)

    def validate(self) -> None:
        if self.time_factor <= 0:
            raise ValueError("--time-factor must be > 0")
        if self.max_inflight <= 0:
            raise ValueError("--max-inflight must be > 0")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be > 0")
        if not self.target.startswith(("http://", "https://")):
            raise ValueError(f"--target must be an http(s) URL, got {self.target!r}")
        self.load.validate()
        if self.clients is not None:
            self.clients.validate()


@dataclass
class Progress:
    elapsed: float = 0.0  # wall s
    total: float = 1.0  # wall s (expected)
    sent: int = 0
    done: int = 0
    inflight: int = 0
    errors: int = 0
    met: int = 0


class Replay:
    def __init__(self, cfg: ReplayConfig, trace: Trace | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.trace = trace or load_trace(cfg.trace, fmt=cfg.fmt)
        ids, fmt = read_block_ids(cfg.trace)
        if len(ids) != len(self.trace.requests):
            raise ValueError(
                f"{cfg.trace}: read {len(ids)} block lists for {len(self.trace.requests)} requests"
            )
        vocab = Vocab.from_tokenizer(cfg.tokenizer) if cfg.tokenizer else Vocab.builtin()
        self.vocab = vocab
        self.conv = Conversations(ids, fmt, self.trace.block_size, vocab, len(self.trace.sessions))
        reqs = self.trace.requests
        self.next_in_stream = [-1] * len(reqs)
        self.heads: list[list[int]] = [[] for _ in self.trace.sessions]
        for r in reqs:
            if r.prev >= 0:
                self.next_in_stream[r.prev] = r.idx
            else:
                self.heads[r.session].append(r.idx)
        self.outcomes: list[Outcome] = []
        self.progress = Progress()
        self.sampler = LoadSampler(cfg.window_s)
        self.last_arrival = 0.0
        self.tokcheck: Check | None = None
        # the clients' jitter, seeded by the load's seed (as the simulator's)
        self.client_rng = random.Random(cfg.load.seed * 7919 + 1)

    # -- the run ------------------------------------------------------------------------------
    async def run(self, on_progress: Callable[[Progress], None] | None = None) -> dict:
        cfg = self.cfg
        tf = cfg.time_factor
        starts, w_start, w_end = plan(self.trace, cfg.load)
        mode = cfg.load.mode
        horizon = w_end if mode == "sessions" else math.inf
        drain = cfg.drain_timeout if cfg.drain_timeout is not None else cfg.request_timeout
        expected = (w_end * tf) if mode == "sessions" else w_end * tf * 1.5
        max_wall = cfg.max_wall if cfg.max_wall is not None else expected + drain + 5.0
        self.progress.total = max(1e-3, min(expected, max_wall))
        limits = httpx.Limits(
            max_connections=cfg.max_inflight + 4, max_keepalive_connections=cfg.max_inflight + 4
        )
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        timeout = httpx.Timeout(cfg.request_timeout, connect=min(10.0, cfg.request_timeout))
        tkw = {"transport": cfg.transport} if cfg.transport is not None else {}
        async with httpx.AsyncClient(
            base_url=cfg.target.rstrip("/"), limits=limits, timeout=timeout, headers=headers, **tkw
        ) as client:
            self.client = client
            if cfg.check_tokenizer:  # raises TokenizerMismatch before anything is sent
                self.tokcheck = await check_tokenizer(
                    client, self.vocab, cfg.tokenizer, min(5.0, cfg.request_timeout)
                )
            model = cfg.model or await self._model_name()
            self.model = model
            murl = cfg.metrics_url if cfg.metrics_url is not None else cfg.target.rstrip("/") + "/metrics"
            before = await self._scrape(murl) if murl else None
            self.sem = asyncio.Semaphore(cfg.max_inflight)
            loop = asyncio.get_running_loop()
            self.t0 = loop.time()
            self.wall0 = time.time()
            tasks = [
                asyncio.create_task(self._stream(s, h, horizon, w_start, mode))
                for s in starts
                for h in self.heads[s.session]
            ]
            poller = asyncio.create_task(self._poll(murl, on_progress)) if (murl or on_progress) else None
            deadline = self.t0 + max_wall
            # all arrivals happen by horizon; then drain
            pending = set(tasks)
            while pending:
                now = loop.time()
                if mode == "sessions" and now - self.t0 >= horizon * tf + drain:
                    break
                if now >= deadline:
                    break
                _, pending = await asyncio.wait(pending, timeout=min(0.5, max(0.01, deadline - now)))
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await poller
            after = await self._scrape(murl) if murl and before is not None else None
            wall = loop.time() - self.t0
        if on_progress:
            self.progress.elapsed = wall
            on_progress(self.progress)
        if mode != "sessions":
            w_end = max(w_end, self.last_arrival)
        dec = None
        policy = None
        if after is not None:
            policy = next((lb.get("policy") for n, lb, _ in after if n == "smetric_decisions_total"), None)
        if before is not None and after is not None:
            b, a = decisions(before), decisions(after)
            dec = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
        imb = self.sampler.imbalance(w_start, w_end) if self.sampler.sums else None
        extra = {
            "trace": self.trace.name,
            "policy": policy or "unknown",
            "target": cfg.target,
            "load_mode": mode,
            "session_rate": None if mode == "compress" else round(rate_of(cfg.load, self.trace), 6),
            "rate_scale": cfg.load.rate_scale,
            "sessions": len(starts),
            "warmup_s": w_start,
            "wall_s": wall,
            "requests_sent": self.progress.sent,
            "max_inflight": cfg.max_inflight,
            "slo_b": cfg.slo.b,
            "slo_a_per_1k": cfg.slo.a * 1000.0,
            "vocab": self.vocab.source,
            "tokenizer_check": self.tokcheck.as_dict() if self.tokcheck is not None else None,
            "model": self.model,
        }
        return summarize(
            self.outcomes,
            slo=cfg.slo,
            time_factor=tf,
            w_start=w_start,
            w_end=w_end,
            imbalance=imb,
            decisions_delta=dec,
            clients=cfg.clients.describe() if cfg.clients is not None else None,
            extra=extra,
        )

    async def _model_name(self) -> str:
        try:
            r = await self.client.get("/v1/models", timeout=min(5.0, self.cfg.request_timeout))
            data = r.json().get("data") or []
            if r.status_code == 200 and data and isinstance(data[0].get("id"), str):
                return data[0]["id"]
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return "default"

    async def _scrape(self, url: str):
        try:
            r = await self.client.get(url, timeout=min(5.0, self.cfg.request_timeout))
            if r.status_code != 200:
                return None
            return parse_prometheus(r.text)
        except httpx.HTTPError:
            return None

    async def _poll(self, murl: str | None, on_progress) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        ok = bool(murl)
        while True:
            now = loop.time() - self.t0
            self.progress.elapsed = now
            if on_progress:
                on_progress(self.progress)
            if ok:
                s = await self._scrape(murl)
                if s is None:
                    ok = False
                else:
                    loads = prefill_inflight(s)
                    if loads:
                        self.sampler.add((loop.time() - self.t0) / cfg.time_factor, loads)
            await asyncio.sleep(cfg.poll_s)

    # -- one agent stream -----------------------------------------------------------------------
    async def _stream(self, s: SessionStart, head: int, horizon: float, w_start: float, mode: str) -> None:
        cfg = self.cfg
        tf = cfg.time_factor
        loop = asyncio.get_running_loop()
        reqs = self.trace.requests
        idx = head
        arrival = s.start + reqs[head].offset / s.time_scale
        prev_built: Built | None = None
        while arrival < horizon:
            delay = self.t0 + arrival * tf - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tr = reqs[idx]
            prev_out = reqs[tr.prev].output_len if tr.prev >= 0 else 0
            built = self.conv.build(s.copy, idx, prev_built, tr.prev, prev_out)
            self.last_arrival = max(self.last_arrival, arrival)
            o = Outcome(
                idx=idx,
                copy=s.copy,
                turn=tr.turn,
                arrival=arrival,
                sent_wall=0.0,
                prompt_tokens=tr.input_len,
                measured=w_start <= arrival < horizon,
            )
            self.outcomes.append(o)
            first = None
            while True:
                async with self.sem:
                    if first is None:
                        first = loop.time()
                        o.sent_wall = first - self.t0
                    ra = await self._send(o, built, tr.output_len, f"s{s.copy}", first)
                wait = self._retry_in(o, ra)
                if wait is None:
                    break
                await asyncio.sleep(wait)
            if o.error is not None:
                return  # an agent whose turn failed stops
            nxt = self.next_in_stream[idx]
            if nxt < 0:
                return
            answered = (loop.time() - self.t0) / tf
            ntr = reqs[nxt]
            if mode == "compress":
                arrival = max(s.start + ntr.offset / s.time_scale, answered)
            else:
                arrival = answered + cfg.load.think(ntr.think, s.copy, nxt)
            prev_built = built
            idx = nxt

    def _retry_in(self, o: Outcome, retry_after: float | None) -> float | None:
        """Wall seconds before ``o``'s client retries its failed attempt, or None (it does
        not: no client model, a success, an error the SDKs do not retry, or no retry left)."""
        cm = self.cfg.clients
        if cm is None or o.error is None or not _retriable(o.error) or o.attempts > cm.max_retries:
            return None
        tf = self.cfg.time_factor
        ra = retry_after / tf if retry_after is not None else None
        wait = cm.delay(o.attempts, ra, self.client_rng) * tf
        o.attempts += 1
        o.error = None
        return wait

    async def _send(
        self, o: Outcome, built: Built, output_len: int, session: str, first: float
    ) -> float | None:
        """One attempt of ``o`` (its client's first attempt sent at loop time ``first``, what
        TTFT counts from). Returns the Retry-After of an overload answer (wall seconds)."""
        cfg = self.cfg
        p = self.progress
        p.sent += 1
        p.inflight += 1
        body = {
            "model": self.model,
            "messages": built.messages,
            "max_tokens": max(1, int(output_len)),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            # SGLang's split of the hits (device / storage tier), in an sglext chunk
            "return_cached_tokens_details": True,
        }
        data = orjson.dumps(body)
        loop = asyncio.get_running_loop()
        t_first = t_text = t_last = None
        n_chunks = 0
        usage = None
        meta = None
        finish = None
        retry_after: float | None = None
        got_first = asyncio.Event()

        async def _do() -> None:
            nonlocal t_first, t_text, t_last, n_chunks, usage, meta, finish, retry_after
            async with self.client.stream(
                "POST",
                "/v1/chat/completions",
                content=data,
                headers={"content-type": "application/json", "x-session-token": session},
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode("utf-8", "replace")
                    o.error = f"http_{resp.status_code}: {text}"
                    if resp.status_code in OVERLOAD_STATUS:
                        o.refusals += 1
                        with contextlib.suppress(TypeError, ValueError):
                            retry_after = float(resp.headers.get("retry-after"))
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        obj = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        continue
                    if "error" in obj and not obj.get("choices"):
                        o.error = f"stream_error: {str(obj['error'])[:200]}"
                        return
                    for ch in obj.get("choices") or ():
                        now = loop.time()
                        if t_first is None:  # the answer's first chunk: the first token is made
                            t_first = now
                            got_first.set()
                        delta = ch.get("delta") or {}
                        c = delta.get("content")
                        if c:
                            if t_text is None:
                                t_text = now
                            t_last = now
                            n_chunks += 1
                        if ch.get("finish_reason"):
                            finish = ch["finish_reason"]
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if obj.get("meta_info"):
                        meta = obj["meta_info"]
                    ctd = (obj.get("sglext") or {}).get("cached_tokens_details")
                    if isinstance(ctd, dict) and isinstance(ctd.get("device"), int):
                        meta = {
                            **(meta or {}),
                            "cached_tokens_local": ctd["device"] + int(ctd.get("host") or 0),
                            "cached_tokens_global": int(ctd.get("storage") or 0),
                        }

        try:
            await self._within_patience(_do(), got_first, o)
        except (asyncio.TimeoutError, TimeoutError):
            o.error = "timeout: no complete answer within the request timeout"
            o.timeouts += 1
        except asyncio.CancelledError:
            o.error = "cancelled: still running when the run ended"
            raise
        except httpx.HTTPError as e:
            o.error = f"transport: {type(e).__name__}: {e}"[:300]
        finally:
            p.inflight -= 1
            if o.error is None:
                if finish == "abort" or t_text is None:
                    o.error = f"abort: finish_reason={finish!r}, {n_chunks} content chunks"
            if o.error is not None:
                p.errors += 1
            else:
                p.done += 1
                o.ttft_wall = t_first - first
                o.ttft_text_wall = t_text - first
                o.e2e_wall = loop.time() - first
                n_out = _apply_usage(o, usage, meta, n_chunks)
                if n_out > 1 and t_last is not None and t_last > t_first:
                    o.tpot_wall = (t_last - t_first) / (n_out - 1)
                if o.measured and o.ttft_wall / cfg.time_factor <= cfg.slo.ttft(o.prompt_tokens):
                    p.met += 1
        return retry_after

    async def _within_patience(self, work, got_first: asyncio.Event, o: Outcome) -> None:
        """Run ``work`` (one attempt) within the request timeout and, with a client model, give
        it up (closing its connection) when it has no first token within the client's patience."""
        cfg = self.cfg
        if cfg.clients is None:
            await asyncio.wait_for(work, cfg.request_timeout)
            return
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.ensure_future(work)
        first = asyncio.ensure_future(got_first.wait())
        try:
            patience = cfg.clients.patience_s * cfg.time_factor
            await asyncio.wait(
                {task, first}, timeout=min(patience, cfg.request_timeout), return_when=asyncio.FIRST_COMPLETED
            )
            if not task.done() and not got_first.is_set():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                o.error = "timeout: no first token within the client's patience"
                o.timeouts += 1
                return
            await asyncio.wait_for(task, max(0.0, cfg.request_timeout - (loop.time() - t0)))
        finally:
            first.cancel()
            if not task.done():
                task.cancel()


#: the answers the SDKs retry (besides timeouts and transport errors), counted as refusals
OVERLOAD_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504, 529})


def _apply_usage(o: Outcome, usage: dict | None, meta: dict | None, n_chunks: int) -> int:
    """Copy the answer's token counts (usage, SGLang's meta_info) onto ``o``; returns the
    output token count (the usage's, else the number of content chunks)."""
    n_out = n_chunks
    if usage:
        pt = usage.get("prompt_tokens")
        if isinstance(pt, int) and pt > 0:
            o.prompt_tokens = pt
        ct = usage.get("completion_tokens")
        if isinstance(ct, int) and ct > 0:
            n_out = ct
        det = usage.get("prompt_tokens_details") or {}
        if isinstance(det.get("cached_tokens"), int):
            o.cached = det["cached_tokens"]
    if meta:
        if isinstance(meta.get("cached_tokens"), int):
            o.cached = meta["cached_tokens"]
        if isinstance(meta.get("cached_tokens_local"), int):
            o.cached_local = meta["cached_tokens_local"]
            o.cached_global = int(meta.get("cached_tokens_global") or 0)
    o.output_tokens = n_out
    return n_out


def _retriable(error: str) -> bool:
    """Whether the SDKs retry an attempt that ended in ``error`` (an :class:`Outcome` error):
    408, 409, 429 and 5xx answers, timeouts, transport errors; not an error inside an answer."""
    kind = error.split(":", 1)[0]
    if kind.startswith("http_"):
        code = int(kind[5:]) if kind[5:].isdigit() else 0
        return code in (408, 409, 429) or code >= 500
    return kind in ("timeout", "transport")


def run_replay(cfg: ReplayConfig, on_progress=None) -> dict:
    return asyncio.run(Replay(cfg).run(on_progress))
