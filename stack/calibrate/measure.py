"""The measurement client of ``smetric calibrate``: one request at a time, so a measurement is
one request's own prefill (or decode), never a queue behind another.

Prompts are random token ids (no tokenizer on either side); a fresh random prefix is a
guaranteed cache miss, a prefix sent before is (up to the engine's page granularity) a hit.
The token counts of every measurement are the engine's own (``meta_info`` ``prompt_tokens``
and ``cached_tokens``, or ``usage``), not what was meant to be cached.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import httpx
import orjson

from stack.calibrate.target import Target
from stack.core.observations import TIMING_KEYS


class MeasureError(RuntimeError):
    """A request of the sweep failed (status, body) or answered without what is timed."""


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    prompt_tokens: int
    cached_tokens: int
    seconds: float  # the prefill: forward time (metrics), or client-side seconds / time factor
    queue_s: float  # engine-side queueing (metrics), 0 when unknown

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    context: float  # mean context over the timed steps
    step_s: float  # seconds per decode step (client side, / time factor)
    steps: int


class Meter:
    """Sends the sweep's requests to one :class:`Target`."""

    def __init__(self, client: httpx.Client, target: Target, id_range=(100, 1000)) -> None:
        self.c = client
        self.t = target
        # fresh entropy every run: a second calibration against a warm engine must not send
        # the prompts it has cached from the first
        self.rng = random.Random()
        self.lo, self.hi = id_range

    def fresh(self, n: int) -> list[int]:
        """``n`` random token ids: a prompt (or extension) no engine has seen."""
        r = self.rng
        return [r.randrange(self.lo, self.hi) for _ in range(n)]

    def _body(self, ids: list[int], max_new: int, stream: bool) -> dict:
        if self.t.endpoint == "/generate":
            sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
            return {"input_ids": ids, "sampling_params": sp, "stream": stream}
        return {
            "model": self.t.model,
            "prompt": ids,
            "max_tokens": max_new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    def _post(self, ids: list[int]) -> tuple[dict, float]:
        data = orjson.dumps(self._body(ids, 1, False))
        t0 = time.perf_counter()
        try:
            r = self.c.post(
                self.t.url + self.t.endpoint, content=data, headers={"content-type": "application/json"}
            )
            body = r.content
        except httpx.HTTPError as e:
            raise MeasureError(f"{self.t.endpoint}: {type(e).__name__}: {e}") from None
        wall = time.perf_counter() - t0
        if r.status_code != 200:
            raise MeasureError(f"{self.t.endpoint} answered {r.status_code}: {body[:300]!r}")
        try:
            return orjson.loads(body), wall
        except orjson.JSONDecodeError:
            raise MeasureError(f"{self.t.endpoint} answered a body that is not JSON") from None

    def _stream_one(self, ids: list[int]) -> tuple[dict, float]:
        """Stream a one-token ``/generate`` request: its last frame and the seconds from the
        answer's headers to its first token frame. An SGLang worker (and the emulator) sends
        the headers as soon as it has parsed the body, before the request reaches the
        scheduler, so what this times leaves out the upload and parse of the prompt's ids (the
        host overhead that grows with the prompt) and keeps the engine's queue, forward and
        the first frame's write."""
        data = orjson.dumps(self._body(ids, 1, True))
        last: dict | None = None
        first = None
        try:
            with self.c.stream(
                "POST",
                self.t.url + self.t.endpoint,
                content=data,
                headers={"content-type": "application/json"},
            ) as r:
                headers_at = time.perf_counter()
                if r.status_code != 200:
                    raise MeasureError(
                        f"{self.t.endpoint} (stream) answered {r.status_code}: {r.read()[:300]!r}"
                    )
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.perf_counter()
                    try:
                        last = orjson.loads(line[5:])
                    except orjson.JSONDecodeError:
                        raise MeasureError(
                            f"{self.t.endpoint} (stream) sent a frame that is not JSON"
                        ) from None
        except httpx.HTTPError as e:
            raise MeasureError(f"{self.t.endpoint} (stream): {type(e).__name__}: {e}") from None
        if first is None or not isinstance(last, dict):
            raise MeasureError(f"{self.t.endpoint} (stream) answered no token frame")
        return last, first - headers_at

    def warm(self, ids: list[int]) -> None:
        """Send ``ids`` once (one output token) so the engine caches them as a prefix."""
        self._post(ids)

    def prefill(self, ids: list[int]) -> PrefillTiming:
        """One one-token request on ``ids``: its token counts and its prefill time."""
        t = self.t
        if t.timing == "client" and t.client_clock == "stream":
            obj, wall = self._stream_one(ids)
        else:
            obj, wall = self._post(ids)
        if t.endpoint == "/generate":
            meta = obj.get("meta_info") or {}
            prompt, cached = meta.get("prompt_tokens"), meta.get("cached_tokens", 0)
        else:
            meta = {}
            usage = obj.get("usage") or {}
            prompt = usage.get("prompt_tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if not isinstance(prompt, int) or not isinstance(cached, int):
            raise MeasureError(f"{t.endpoint}: the answer has no prompt / cached token counts")
        if t.timing == "metrics":
            try:
                start, end = (float(meta[k]) for k in TIMING_KEYS)
            except (KeyError, TypeError, ValueError):
                raise MeasureError(f"meta_info without {' / '.join(TIMING_KEYS)}") from None
            return PrefillTiming(prompt, cached, end - start, float(meta.get("queue_time") or 0.0))
        return PrefillTiming(prompt, cached, wall / t.time_factor, 0.0)

    def decode(self, ids: list[int], steps: int) -> DecodeTiming:
        """Stream ``steps`` output tokens on ``ids``; the seconds per step (client side): the
        median over consecutive reads of the socket of their seconds per token. Frames are timed
        by the read that brought them, so a stall of the client, after which several frames come
        in one read, gives one sample (its wait over its tokens), not one near-zero gap per frame
        (timing each frame as it was parsed, a CI run read a TPOT 300x short; the first-to-last
        mean, 8x short)."""
        t = self.t
        data = orjson.dumps(self._body(ids, steps, True))
        seen: list[tuple[float, int]] = []
        count = 0
        try:
            with self.c.stream(
                "POST", t.url + t.endpoint, content=data, headers={"content-type": "application/json"}
            ) as r:
                if r.status_code != 200:
                    raise MeasureError(f"{t.endpoint} (stream) answered {r.status_code}")
                pending = b""
                for chunk in r.iter_bytes():
                    now = time.perf_counter()
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        line = line.strip()
                        if not line.startswith(b"data:") or line == b"data: [DONE]":
                            continue
                        try:
                            obj = orjson.loads(line[5:])
                        except orjson.JSONDecodeError:
                            continue
                        count = max(count, _tokens_so_far(obj, count))
                    if count > (seen[-1][1] if seen else 0):
                        seen.append((now, count))
        except httpx.HTTPError as e:
            raise MeasureError(f"{t.endpoint} (stream): {type(e).__name__}: {e}") from None
        if len(seen) < 2 or seen[-1][1] <= seen[0][1]:
            raise MeasureError(f"decode of {steps} tokens streamed fewer than two timed frames")
        (_, n0), (_, n1) = seen[0], seen[-1]
        per_token = [(tb - ta) / (nb - na) for (ta, na), (tb, nb) in zip(seen, seen[1:], strict=False)]
        step = statistics.median(per_token) / t.time_factor
        return DecodeTiming(len(ids) + (n0 + n1) / 2, step, n1 - n0)


def _tokens_so_far(obj: dict, count: int) -> int:
    """Output tokens streamed so far: ``/generate``'s ``meta_info.completion_tokens`` (or its
    cumulative ``output_ids``); a completions chunk with text adds one."""
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
        return meta["completion_tokens"]
    ids = obj.get("output_ids")
    if isinstance(ids, list):
        return len(ids)
    for ch in obj.get("choices") or ():
        if ch.get("text"):
            return count + 1
    return count
