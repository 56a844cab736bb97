"""Per-key limits: a request rate, a prompt-token rate and a concurrency cap.

- **Requests** (``requests_per_s``, burst ``request_burst``): a token bucket; each request
  takes one token at admission, before its body is read.
- **Prompt tokens** (``prompt_tokens_per_s``, burst ``prompt_token_burst``): a bucket that may
  go into debt. At admission the key is refused while its bucket is empty (nothing of the body
  read yet); once the body is tokenized, the request is charged its prompt tokens, and refused
  if another request emptied the bucket in between. A prompt larger than the burst still
  passes once the bucket has any tokens, and the debt holds the key's next requests back for
  as long as it takes to repay: over time a key gets its rate, whatever its prompt sizes.
- **Concurrency** (``max_concurrency``): requests admitted and not yet answered (a stream
  counts until its last byte).

A refusal carries the seconds until the limit would let the request pass (``Retry-After``).

:class:`LocalLimiter` keeps the state in this process. :class:`SharedLimiter` keeps it in the
router replicas' Redis (``router.redis_url``), one Lua script per decision, so the limits hold
for the whole cluster; while Redis is unreachable each replica falls back to its own
:class:`LocalLimiter` (docs/deploy/security.md, "API keys and limits", states the accuracy).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("stack.router.limits")


@dataclass(frozen=True, slots=True)
class Limits:
    """One key's limits (None: no such limit)."""

    requests_per_s: float | None = None
    request_burst: float | None = None
    prompt_tokens_per_s: float | None = None
    prompt_token_burst: float | None = None
    max_concurrency: int | None = None

    @classmethod
    def of(cls, **kw) -> Limits:
        """Limits with their bursts defaulted: ``max(1, requests_per_s)`` requests and
        ``prompt_tokens_per_s`` tokens (one second's worth)."""
        rr, rb = kw.get("requests_per_s"), kw.get("request_burst")
        tr, tb = kw.get("prompt_tokens_per_s"), kw.get("prompt_token_burst")
        if rb is not None and rr is None:
            raise ValueError("'request_burst' needs 'requests_per_s'")
        if tb is not None and tr is None:
            raise ValueError("'prompt_token_burst' needs 'prompt_tokens_per_s'")
        if rr is not None and rb is None:
            rb = max(1.0, float(rr))
        if rb is not None and rb < 1:
            raise ValueError("'request_burst' must be at least 1")
        if tr is not None and tb is None:
            tb = float(tr)
        mc = kw.get("max_concurrency")
        return cls(
            None if rr is None else float(rr),
            None if rb is None else float(rb),
            None if tr is None else float(tr),
            None if tb is None else float(tb),
            None if mc is None else int(mc),
        )

    @property
    def any(self) -> bool:
        return (
            self.requests_per_s is not None
            or self.prompt_tokens_per_s is not None
            or self.max_concurrency is not None
        )


#: why a request was refused: its key's request rate, prompt-token rate or concurrency cap
REASONS = ("requests", "prompt_tokens", "concurrency")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request over one of its key's limits."""

    reason: str  # one of REASONS
    retry_after_s: int  # whole seconds, at least 1

    def message(self, name: str, lim: Limits) -> str:
        if self.reason == "requests":
            what = f"request rate limit of {lim.requests_per_s:g}/s (burst {lim.request_burst:g})"
        elif self.reason == "prompt_tokens":
            what = (
                f"prompt-token rate limit of {lim.prompt_tokens_per_s:g}/s (burst {lim.prompt_token_burst:g})"
            )
        else:
            what = f"limit of {lim.max_concurrency} concurrent requests"
        return f"API key {name!r} is over its {what}; retry after {self.retry_after_s} s"


def _refusal(reason: str, seconds: float) -> Refusal:
    return Refusal(reason, max(1, math.ceil(seconds)))


class LocalLimiter:
    """The limits of every key, in this process (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._req: dict[str, list[float]] = {}  # name -> [level, last refill]
        self._tok: dict[str, list[float]] = {}
        self.inflight: dict[str, int] = {}

    @staticmethod
    def _level(
        buckets: dict[str, list[float]], name: str, rate: float, burst: float, now: float
    ) -> list[float]:
        b = buckets.get(name)
        if b is None:
            b = buckets[name] = [burst, now]
        else:
            b[0] = min(burst, b[0] + max(0.0, now - b[1]) * rate)
            b[1] = now
        return b

    def admit(self, name: str, lim: Limits) -> Refusal | None:
        """Admit one request of key ``name`` (taking a request token and a concurrency slot),
        or the refusal; nothing is taken when it is refused."""
        now = self.clock()
        mc = lim.max_concurrency
        if mc is not None and self.inflight.get(name, 0) >= mc:
            return _refusal("concurrency", 1)
        if lim.prompt_tokens_per_s is not None:
            tb = self._level(self._tok, name, lim.prompt_tokens_per_s, lim.prompt_token_burst, now)
            if tb[0] <= 0:
                return _refusal("prompt_tokens", (1e-3 - tb[0]) / lim.prompt_tokens_per_s)
        if lim.requests_per_s is not None:
            rb = self._level(self._req, name, lim.requests_per_s, lim.request_burst, now)
            if rb[0] < 1:
                return _refusal("requests", (1 - rb[0]) / lim.requests_per_s)
            rb[0] -= 1
        if mc is not None:
            self.inflight[name] = self.inflight.get(name, 0) + 1
        return None

    def charge(self, name: str, lim: Limits, tokens: int) -> Refusal | None:
        """Charge an admitted request's ``tokens`` prompt tokens, or refuse it (the bucket
        was emptied since its admission)."""
        if lim.prompt_tokens_per_s is None:
            return None
        tb = self._level(self._tok, name, lim.prompt_tokens_per_s, lim.prompt_token_burst, self.clock())
        if tb[0] <= 0:
            return _refusal("prompt_tokens", (1e-3 - tb[0]) / lim.prompt_tokens_per_s)
        tb[0] -= tokens
        return None

    def release(self, name: str) -> None:
        """An admitted request of key ``name`` ended (its concurrency slot is free)."""
        n = self.inflight.get(name, 0)
        if n <= 1:
            self.inflight.pop(name, None)
        else:
            self.inflight[name] = n - 1


# -- Redis ------------------------------------------------------------------------------------
# Keys (ns = router.redis_namespace): ns:auth:<name>:req and ns:auth:<name>:tok (hashes
# {l: level, t: last refill, Redis clock}), ns:auth:<name>:conc (hash "<replica>\t<token>" ->
# requests in flight; a count is dropped once the replica's heartbeat key ns:hb:<replica> is
# gone or holds another process's token: a dead or restarted replica's requests stop counting).
_LEVEL = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function level(key, rate, burst)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, ts = tonumber(v[1]), tonumber(v[2])
  if l == nil then return burst end
  return math.min(burst, l + math.max(0, now - ts) * rate)
end
local function store(key, l, rate, burst)
  redis.call('HSET', key, 'l', string.format('%.6f', l), 't', string.format('%.6f', now))
  redis.call('PEXPIRE', key, math.ceil((burst - l) / rate * 1000) + 60000)
end
"""

# ADMIT(ns, name, me, req_rate, req_burst, tok_rate, tok_burst, max_conc) -> {code, retry_ms}
# code 0 admitted, 1 request rate, 2 prompt tokens, 3 concurrency (rates 0: no such limit)
_ADMIT = (
    _LEVEL
    + r"""
local ns, name, me = ARGV[1], ARGV[2], ARGV[3]
local rr, rb, tr, tb, mc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local base = ns .. ':auth:' .. name
local conc = base .. ':conc'
if mc > 0 then
  local total = 0
  local h = redis.call('HGETALL', conc)
  for i = 1, #h, 2 do
    local f = h[i]
    local tab = string.find(f, '\t', 1, true)
    local live = f == me
    if not live and tab then
      live = redis.call('GET', ns .. ':hb:' .. string.sub(f, 1, tab - 1)) == string.sub(f, tab + 1)
    end
    if live then total = total + tonumber(h[i + 1]) else redis.call('HDEL', conc, f) end
  end
  if total >= mc then return {3, 1000} end
end
if tr > 0 then
  local l = level(base .. ':tok', tr, tb)
  if l <= 0 then return {2, math.ceil((1e-3 - l) / tr * 1000)} end
end
if rr > 0 then
  local k = base .. ':req'
  local l = level(k, rr, rb)
  if l < 1 then return {1, math.ceil((1 - l) / rr * 1000)} end
  store(k, l - 1, rr, rb)
end
if mc > 0 then
  redis.call('HINCRBY', conc, me, 1)
  redis.call('PEXPIRE', conc, 86400000)
end
return {0, 0}
"""
)

# CHARGE(ns, name, tok_rate, tok_burst, tokens) -> {code, retry_ms}
_CHARGE = (
    _LEVEL
    + r"""
local k = ARGV[1] .. ':auth:' .. ARGV[2] .. ':tok'
local tr, tb, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local l = level(k, tr, tb)
if l <= 0 then return {2, math.ceil((1e-3 - l) / tr * 1000)} end
store(k, l - n, tr, tb)
return {0, 0}
"""
)

# RELEASE(ns, me, name, n, name, n, ...) -> 0
_RELEASE = r"""
local ns, me = ARGV[1], ARGV[2]
for i = 3, #ARGV, 2 do
  local conc = ns .. ':auth:' .. ARGV[i] .. ':conc'
  if redis.call('HINCRBY', conc, me, -tonumber(ARGV[i + 1])) <= 0 then redis.call('HDEL', conc, me) end
end
return 0
"""

_CODES = {1: "requests", 2: "prompt_tokens", 3: "concurrency"}


class SharedLimiter:
    """The limits in the router replicas' Redis: one script per admission and per charge, so
    every replica sees every request of a key. ``replica``: this replica's id in the shared
    state (whose heartbeat tells its concurrency counts live); ``is_up``: whether the shared
    state reaches Redis (when not, :attr:`local` decides); ``token``: the value of this
    process's heartbeat key (:class:`~stack.prefill_router.shared_state.SharedState`)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        replica: str,
        token: str,
        timeout_s: float,
        is_up: Callable[[], bool],
    ) -> None:
        from stack.prefill_router.shared_connection import one_try_client

        self.ns = namespace
        self.me = f"{replica}\t{token}"
        self.timeout_s = timeout_s
        self.is_up = is_up
        self.local = LocalLimiter()
        self.r = one_try_client(url, timeout_s, asyncio=True)
        self._admit = self.r.register_script(_ADMIT)
        self._charge = self.r.register_script(_CHARGE)
        self._release = self.r.register_script(_RELEASE)
        self._unreleased: dict[str, int] = {}  # releases not yet written (Redis failed)
        self._tasks: set[asyncio.Task] = set()
        self.errors = 0

    async def _call(self, script, args: list) -> list | None:
        """The script's answer, or None when Redis failed (the caller decides locally)."""
        try:
            return await asyncio.wait_for(script(args=args), self.timeout_s * 2 + 0.05)
        except Exception as e:  # noqa: BLE001 - any Redis failure: decide locally
            self.errors += 1
            log.warning(
                "per-key limits: Redis call failed (%s): this replica decides alone", type(e).__name__
            )
            return None

    async def admit(self, name: str, lim: Limits) -> tuple[Refusal | None, bool]:
        """(the refusal or None, whether Redis decided: the release must go there too)."""
        if self.is_up():
            got = await self._call(
                self._admit,
                [
                    self.ns,
                    name,
                    self.me,
                    lim.requests_per_s or 0,
                    lim.request_burst or 0,
                    lim.prompt_tokens_per_s or 0,
                    lim.prompt_token_burst or 0,
                    lim.max_concurrency or 0,
                ],
            )
            if got is not None:
                code, ms = int(got[0]), int(got[1])
                return (None if code == 0 else _refusal(_CODES[code], ms / 1000)), True
        return self.local.admit(name, lim), False

    async def charge(self, name: str, lim: Limits, tokens: int, shared: bool) -> Refusal | None:
        if lim.prompt_tokens_per_s is None:
            return None
        if shared and self.is_up():
            got = await self._call(
                self._charge, [self.ns, name, lim.prompt_tokens_per_s, lim.prompt_token_burst, tokens]
            )
            if got is not None:
                return None if int(got[0]) == 0 else _refusal("prompt_tokens", int(got[1]) / 1000)
        return self.local.charge(name, lim, tokens)

    def release(self, name: str, shared: bool) -> None:
        """Free the concurrency slot, in a background write (kept and retried with the next
        one when Redis fails)."""
        if not shared:
            self.local.release(name)
            return
        self._unreleased[name] = self._unreleased.get(name, 0) + 1
        if len(self._tasks) < 4:  # one write carries every release made meanwhile
            t = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        while self._unreleased:
            batch, self._unreleased = self._unreleased, {}
            args: list = [self.ns, self.me]
            for name, n in batch.items():
                args += [name, n]
            if await self._call(self._release, args) is None:
                for name, n in batch.items():
                    self._unreleased[name] = self._unreleased.get(name, 0) + n
                return

    async def close(self) -> None:
        for t in list(self._tasks):
            try:
                await asyncio.wait_for(asyncio.shield(t), self.timeout_s * 2 + 0.1)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self._unreleased:
            await self._flush()
        try:
            await self.r.aclose()
        except Exception:  # noqa: BLE001
            pass
