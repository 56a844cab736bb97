"""API keys and per-key limits in front of the router's client endpoints (``router.auth``).

Every path needs a valid key except ``/health`` (probes must not carry secrets; it says
nothing about any client), ``/metrics`` unless ``router.auth.protect_metrics`` (scrapers;
it shows key *names*, never keys) and ``/admin/...`` (its own bearer token): SGLang's own
choice for ``/health*`` and ``/metrics``. A key comes as ``x-api-key: <key>`` (Anthropic's
SDK) or ``Authorization: Bearer <key>`` (OpenAI's; when both are sent, ``x-api-key``).

The inference endpoints (:data:`~stack.prefill_router.api.endpoints.ENDPOINTS`) also check
the key's limits (and ``/v1/models`` and the tokenize endpoints, :data:`LIMITED_PATHS`, its
request-rate and concurrency limits) (:mod:`stack.prefill_router.limits`): request rate and concurrency before
the body is read, prompt tokens once it is parsed (:meth:`Gate.charge`). Refusals are in the
endpoint's API shape (:class:`~stack.prefill_router.api.errors.Envelope`): 401 for a missing,
malformed or unknown key, 431 for a key header over ``max_key_bytes``, 429 with
``Retry-After`` over a limit.

Metrics by key *name*: ``smetric_key_requests_total{key}`` (admitted),
``smetric_key_rejections_total{key, reason}`` (``key="-"`` when no known key was sent;
reasons: missing, malformed, too_large, invalid, requests, prompt_tokens, concurrency),
``smetric_key_prompt_tokens_total{key}`` and ``smetric_key_inflight{key}``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from stack.config import AuthConfig
from stack.prefill_router.api.errors import ANTHROPIC, OPENAI, Envelope
from stack.prefill_router.api.parse import Parsed
from stack.prefill_router.auth import ApiKey, KeyStore, load_keys
from stack.prefill_router.limits import LocalLimiter, Refusal, SharedLimiter

log = logging.getLogger("stack.router.auth")

#: paths open without a key (``/metrics`` too unless ``protect_metrics``)
OPEN_PATHS = frozenset({"/health"})
#: client endpoints that are not inference but cost the router work (a tokenizer pass, a
#: listing): they take the key's request-rate and concurrency limits too, not its prompt tokens
LIMITED_PATHS = frozenset({"/v1/models", "/v1/tokenize", "/tokenize", "/model_info", "/get_model_info"})
_KEY_CHARS = re.compile(rb"[\x21-\x7e]+")
_NO_KEY = "no API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


@dataclass(slots=True)
class Ticket:
    """An admitted request's key, and where its concurrency slot is held."""

    key: ApiKey
    #: Redis decided its admission (its release goes there too)
    shared: bool = False
    #: it holds a concurrency slot
    slot: bool = False


class _Refused(Exception):
    """A request refused before its key was known (reason: a rejection metric's label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def presented_key(headers: list[tuple[bytes, bytes]], max_bytes: int) -> bytes:
    """The key a request presents (``x-api-key``, else ``Authorization: Bearer``), or
    :class:`_Refused` (missing, malformed, too_large)."""
    xkey = auth = None
    for k, v in headers:
        if k == b"x-api-key":
            xkey = v
        elif k == b"authorization":
            auth = v
    raw = xkey if xkey is not None else auth
    if raw is None:
        raise _Refused("missing", _NO_KEY)
    if len(raw) > max_bytes:
        which = "x-api-key" if xkey is not None else "Authorization"
        raise _Refused(
            "too_large", f"the {which} header is {len(raw)} bytes, over the {max_bytes} a key may have"
        )
    if xkey is None:
        scheme, _, key = raw.strip().partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise _Refused("malformed", "the Authorization header must be 'Bearer <key>'")
    else:
        key = raw.strip()
    if not key:
        raise _Refused("missing", _NO_KEY)
    if not _KEY_CHARS.fullmatch(key):
        raise _Refused("malformed", "the API key has characters no key has (printable ASCII only)")
    return key


def envelope_for(path: str) -> Envelope:
    """The error envelope of a path that is not an inference endpoint."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "smetric_key_requests", "requests admitted, by API key name", ["key"], registry=registry
        )
        self.rejections = Counter(
            "smetric_key_rejections",
            "requests refused by API key checks and limits, by key name ('-': no known key) and reason",
            ["key", "reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "smetric_key_prompt_tokens",
            "prompt tokens of admitted requests, by API key name",
            ["key"],
            registry=registry,
        )
        self.inflight = Gauge(
            "smetric_key_inflight", "requests in flight, by API key name", ["key"], registry=registry
        )
        self._by_name: dict[str, tuple] = {}

    def of(self, name: str) -> tuple:
        """(requests, prompt tokens, in flight) children of key ``name``."""
        c = self._by_name.get(name)
        if c is None:
            c = self._by_name[name] = (
                self.requests.labels(name),
                self.prompt_tokens.labels(name),
                self.inflight.labels(name),
            )
        return c


class Gate:
    """Keys and limits of one router (module docstring). ``shared``: the replicas' shared
    state (with ``redis``: the router config's Redis settings), for cluster-wide limits."""

    def __init__(self, cfg: AuthConfig, registry: CollectorRegistry, shared=None, redis=None) -> None:
        self.cfg = cfg
        self.max_key = cfg.max_key_bytes
        self.store: KeyStore = load_keys(cfg)
        self.open = OPEN_PATHS if cfg.protect_metrics else OPEN_PATHS | {"/metrics"}
        self.local = LocalLimiter()
        self.shared: SharedLimiter | None = None
        if shared is not None and redis is not None:
            self.shared = SharedLimiter(
                redis.redis_url,
                redis.redis_namespace,
                shared.rid,
                shared.conn.token,  # the value of its heartbeat key: tells a live process's counts
                redis.redis_timeout_s,
                lambda: shared.up,
            )
        self.m = _Metrics(registry)
        log.info("API keys on: %d key(s) from %s", len(self.store), self.store.source)

    @property
    def counts_tokens(self) -> bool:
        """Whether any key has a prompt-token limit (prompts must then be tokenized)."""
        return any(k.limits.prompt_tokens_per_s is not None for k in self.store.by_digest.values())

    # -- checks ---------------------------------------------------------------------------------
    def _identify(self, scope) -> ApiKey | _Refused:
        try:
            key = presented_key(scope["headers"], self.max_key)
        except _Refused as r:
            return r
        k = self.store.find(key)
        if k is None:
            return _Refused("invalid", "invalid API key")
        return k

    def _refuse(self, r: _Refused, env: Envelope) -> Response:
        self.m.rejections.labels("-", r.reason).inc()
        if r.reason == "too_large":
            return env.header_too_large(r.message)
        return env.unauthorized(r.message, f"{r.reason}_api_key")  # missing, malformed, invalid

    def _over(self, k: ApiKey, refusal: Refusal, env: Envelope) -> Response:
        self.m.rejections.labels(k.name, refusal.reason).inc()
        return env.rate_limited(refusal.message(k.name, k.limits), refusal.reason, refusal.retry_after_s)

    def check(self, scope) -> Response | None:
        """A path that is not an inference endpoint: None when it is open or the key is valid,
        else the refusal."""
        path = scope["path"]
        if path in self.open or path.startswith("/admin/"):
            return None
        got = self._identify(scope)
        if isinstance(got, _Refused):
            return self._refuse(got, envelope_for(path))
        return None

    async def admit(self, scope, env: Envelope) -> Ticket | Response:
        """An inference request: its key checked and its request-rate and concurrency limits
        taken (before its body is read), or the refusal."""
        got = self._identify(scope)
        if isinstance(got, _Refused):
            return self._refuse(got, env)
        lim = got.limits
        t = Ticket(got)
        if lim.any:
            if self.shared is not None:
                refusal, t.shared = await self.shared.admit(got.name, lim)
            else:
                refusal = self.local.admit(got.name, lim)
            if refusal is not None:
                return self._over(got, refusal, env)
            t.slot = lim.max_concurrency is not None
        req, _, inflight = self.m.of(got.name)
        req.inc()
        inflight.inc()
        return t

    async def charge(self, request: Request, p: Parsed, env: Envelope) -> Response | None:
        """A parsed request: its prompt tokens counted for its key and charged to its
        prompt-token limit, or the refusal (the hook of
        :class:`~stack.prefill_router.api.inference.InferenceHandler`)."""
        t: Ticket | None = request.scope.get("smetric.key")
        if t is None:
            return None
        k = t.key
        n = p.features.prompt_tokens
        if k.limits.prompt_tokens_per_s is not None:
            if self.shared is not None:
                refusal = await self.shared.charge(k.name, k.limits, n, t.shared)
            else:
                refusal = self.local.charge(k.name, k.limits, n)
            if refusal is not None:
                return self._over(k, refusal, env)
        self.m.of(k.name)[1].inc(n)
        return None

    def release(self, t: Ticket) -> None:
        """The admitted request ended."""
        self.m.of(t.key.name)[2].dec()
        if t.slot:
            if self.shared is not None:
                self.shared.release(t.key.name, t.shared)
            else:
                self.local.release(t.key.name)

    # -- admin ----------------------------------------------------------------------------------
    def reload(self) -> dict:
        """Read the keys again (``POST /admin/auth/reload``); a file or variable that cannot be
        read raises :class:`~stack.prefill_router.auth.AuthConfigError` and the keys in use
        stay. Requests in flight keep their key; limits carry their state by key name."""
        store = load_keys(self.cfg)
        self.store = store
        log.info("API keys reloaded: %d key(s) from %s", len(store), store.source)
        return self.describe()

    def describe(self) -> dict:
        """The keys' names and limits (never a key or a digest)."""
        keys = []
        for k in sorted(self.store.by_digest.values(), key=lambda k: k.name):
            lim = {f: getattr(k.limits, f) for f in k.limits.__slots__ if getattr(k.limits, f) is not None}
            keys.append({"name": k.name, "limits": lim})
        return {"source": self.store.source, "keys": keys, "shared_limits": self.shared is not None}

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()
