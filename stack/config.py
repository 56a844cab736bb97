"""Deployment configuration: a pydantic schema and a YAML loader.

One YAML file describes a deployment: the model, the router, the prefill and decode pools,
the optional Mooncake global tier, and a free-form ``launch`` section owned by the
launcher (unknown keys there, and at the top level, are kept and never rejected).

    model:   {name, path, page_size, context_length}
    router:  {host, port, policy, policy_params, hardware, slo: {b, a_per_1k}, ...}
    prefill: [{url, bootstrap_port, kv_events}]
    decode:  [{url}]
    mooncake: {master, metadata_url}     # optional
    launch:  {...}                       # free-form, the launcher's
"""

from __future__ import annotations

import difflib
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from stack.dispatch import ROUTER_DISPATCH, DispatchSpec

#: the product's routing policy: what the router runs unless a config names another, what every
#: shipped config runs (tests/unit/test_shipped_configs.py holds them to it), and what the main
#: job measures behind :data:`~stack.dispatch.ROUTER_DISPATCH`
PRODUCT_POLICY = "smetric-global"


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    name: str = "default"
    path: str | None = None  # local model dir (tokenizer.json + tokenizer_config.json)
    page_size: int = Field(64, ge=1)
    context_length: int = Field(131072, ge=1)
    #: SGLang's ``--tool-call-parser`` for this model's call format (``qwen3_coder`` for
    #: Qwen3-Coder): without it a worker answers a tool call as plain text and an agent's
    #: tool turn breaks. Both launchers give it to every worker (real SGLang and the emulator)
    tool_call_parser: str | None = None
    #: SGLang's ``--reasoning-parser``, only for a model that thinks (Qwen3-Coder does not);
    #: real SGLang workers only (the emulator does not think)
    reasoning_parser: str | None = None


class SLOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    b: float = Field(1.0, ge=0)
    a_per_1k: float = Field(0.0625, ge=0)  # seconds per 1k prompt tokens


class AuthConfig(BaseModel):
    """``router.auth``: API keys on the client endpoints with per-key limits
    (:mod:`stack.prefill_router.auth`; docs/deploy.md, "API keys and limits"), and the keys the
    router sends to workers started with SGLang's ``--api-key`` / ``--admin-api-key``.

    Client keys are on when ``keys_file`` or ``keys_env`` is set: a YAML (or JSON) mapping
    ``{keys: [{name, key | sha256, requests_per_s, request_burst, prompt_tokens_per_s,
    prompt_token_burst, max_concurrency}], defaults: {...limits}}``, read at start (a file or
    variable that cannot be read stops the router) and again on ``POST /admin/auth/reload``."""

    model_config = ConfigDict(extra="forbid")

    #: the keys file (hashes preferred: ``sha256: <hex of the key>``; plaintext ``key:`` too)
    keys_file: str | None = None
    #: an env var holding the same YAML/JSON text (e.g. from a Kubernetes Secret)
    keys_env: str | None = None
    #: ``/metrics`` needs a valid key too (default: open, as SGLang leaves it, for scrapers;
    #: ``/health`` is always open, for probes)
    protect_metrics: StrictBool = False
    #: the longest key header accepted (longer: 431, before any hashing)
    max_key_bytes: int = Field(1024, ge=16, le=65536)
    #: env var with the key the router sends workers started with SGLang's ``--api-key``
    #: (``Authorization: Bearer``, on hand-offs, health checks and load polls)
    worker_api_key_env: str | None = None
    #: env var with the workers' ``--admin-api-key``: SGLang accepts only it on
    #: ``/abort_request`` once set, so without it the router's aborts would be refused
    worker_admin_api_key_env: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether client keys are required."""
        return bool(self.keys_file or self.keys_env)


class TracingConfig(BaseModel):
    """OpenTelemetry tracing of the router (``router.tracing``; docs/deploy.md, "Tracing").

    ``enabled: false`` (the default): no tracer, no span and no ``traceparent`` header. ``enabled:
    true``: each sampled request gets spans (receive, parse, queue wait, route, prefill, decode,
    first token, stream) and both PD workers get a W3C ``traceparent`` naming the router's span,
    so SGLang's own spans (``--enable-trace``) join the trace; a client's ``traceparent`` is
    continued. The spans are exported over OTLP only when ``endpoint`` is set."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = False
    #: OTLP collector: http/protobuf ``http://host:4318/v1/traces`` (``/v1/traces`` is added to
    #: an endpoint without a path), gRPC ``http://host:4317``; None: spans are not exported
    endpoint: str | None = None
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    #: share of new traces sampled (a client's sampled flag is followed as it comes)
    sampling_ratio: float = Field(1.0, ge=0, le=1)
    service_name: str = "smetric-router"
    export_timeout_s: float = Field(10.0, gt=0)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"tracing endpoint must start with http:// or https:// (got {v!r})")
        return v or None


class RecordConfig(BaseModel):
    """``router.record``: a trace of what the router serves, for ``smetric advise`` and the
    simulator (docs/router.md, "Recording what the router serves").

    Off by default. On, each answered or refused inference request becomes one line of
    Mooncake JSONL (the format ``smetric sim --trace`` reads): its arrival, prompt and output
    tokens, its prompt's chained block ids (the router's block hashes grouped into
    ``block_tokens``-token blocks, each keyed with a secret salt: equal prefixes still match,
    no text or token can be recovered), the session, turn and parent the router infers, any
    session hint the client sent, the routing decision, TTFT, completion time and outcome.
    A writer thread does the work off the request path; files rotate at ``rotate_bytes`` and
    the oldest go once the directory holds more than ``max_bytes``."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = False
    #: where the files go (one series per router replica: ``record-<replica>-<n>.jsonl``)
    dir: str = "smetric-record"
    #: environment variable holding the salt the block ids are keyed with; every replica of a
    #: deployment must get the same one for their files to merge. Unset or empty: a random
    #: salt kept in ``<dir>/salt`` (mode 0600), which replicas sharing the directory share
    salt_env: str = "SMETRIC_RECORD_SALT"
    #: tokens per recorded block: a multiple of ``model.page_size`` (64: the agentic traces')
    block_tokens: int = Field(64, ge=1)
    #: a file is closed and a new one begun past this size
    rotate_bytes: int = Field(64 << 20, ge=4096)
    #: the directory's recordings are kept under this size: the oldest files go first
    max_bytes: int = Field(1 << 30, ge=4096)
    #: requests waiting for the writer; past it a request is not recorded (counted)
    queue: int = Field(10_000, ge=1)


class CostModelConfig(BaseModel):
    """``router.cost_model``: what the router prices prefills with (docs/calibrate.md).

    ``static``: the calibration ``router.hardware`` names, as configured. ``observe``: the
    router also records each prefill's timing from the prefill worker's answer (SGLang's
    ``--enable-metrics`` meta_info), fits the pool's own cost model and exports it (metrics,
    ``/admin/cost_model``), but keeps pricing with the configured one. ``learn``: as observe,
    and SMetric's SLO check (and every other use of the cost model) switches to the fitted
    model while it is trustworthy, back to the configured one when it is not. A bare string
    (``cost_model: learn``) sets the mode."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["static", "observe", "learn"] = "static"
    #: observations kept (the newest); the fit uses lone prefills and busy stretches (chains of
    #: overlapping prefills on one worker, each fitted as one row: docs/calibrate.md)
    buffer: int = Field(2000, ge=10)
    #: trust: at least this many fitted rows (lone prefills or busy stretches) ...
    min_observations: int = Field(40, ge=5)
    #: ... whose new-token counts span at least this ratio (largest / smallest) ...
    min_span: float = Field(4.0, ge=1)
    #: ... a held-out error (MAPE, every holdout_every-th observation) at most this ...
    max_mape: float = Field(0.15, gt=0)
    holdout_every: int = Field(5, ge=2)
    #: ... and coefficients within these bounds (seconds per token, per token^2, per forward)
    max_c_linear: float = Field(1e-2, gt=0)
    max_c_attn: float = Field(1e-6, gt=0)
    max_c_fwd: float = Field(5.0, gt=0)
    #: refit after this many new observations (or every 1/20 of those held, if more)
    refit_every: int = Field(10, ge=1)
    #: a stretch whose first prefill queued longer than this (and not behind the worker's
    #: previous stretch) began behind unseen work: not fitted
    max_queue_s: float = Field(0.005, ge=0)


class FrontDoorConfig(BaseModel):
    """``router.front_door``: what one client connection may hold of the router before its
    request reaches the app (:mod:`stack.prefill_router.front_door`; docs/router.md, "The front
    door"). Checked on the bytes as they arrive, before the HTTP parser sees them."""

    model_config = ConfigDict(extra="forbid")

    #: the largest request head (request line and headers), in bytes; over it: 431, closed
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    #: the most header lines one request may carry; over it: 431, closed
    max_headers: int = Field(100, ge=8)
    #: seconds from a connection's start (or a kept-alive connection's next request's first
    #: byte) to the end of the request's headers; over it: 408, closed
    header_timeout_s: float = Field(10.0, gt=0)
    #: seconds from the end of the headers to the end of the body; over it: 408 in the API's
    #: shape, closed (the request is counted with status 408)
    body_timeout_s: float = Field(60.0, gt=0)
    #: seconds an idle kept-alive connection stays open (longer than common clients' own
    #: idle expiry, so that the client closes first)
    keep_alive_s: float = Field(20.0, gt=0)
    #: open client connections; a connection beyond them gets 503 with Retry-After in the
    #: API's shape and is closed (the router raises its open-file limit to fit)
    max_connections: int = Field(4096, ge=1)


class ModelNamesConfig(BaseModel):
    """``router.models``: the ``model`` names a request may carry (docs/router.md, "Model
    names"). Accepted: ``model.name``, the aliases, a name matching a pattern, any of those
    with a LoRA adapter after a colon (SGLang's ``base:adapter``), and a request with no
    ``model``; any other name is answered 404 in the endpoint's API shape."""

    model_config = ConfigDict(extra="forbid")

    #: other names of the served model (e.g. the Hugging Face id clients know it by)
    aliases: list[str] = Field(default_factory=list)
    #: shell-style patterns (``fnmatch``, case-sensitive) of names also accepted: by default
    #: the ``claude-*`` names Claude Code sends; ``["*"]`` accepts every name
    accept: list[str] = Field(default_factory=lambda: ["claude-*"])


class AdminConfig(BaseModel):
    """``router.admin``: what the admin API may do (docs/router.md, "Admin API")."""

    model_config = ConfigDict(extra="forbid")

    #: networks (CIDR, e.g. 10.0.0.0/8) a worker added at run time must be in: its host is an
    #: address in one of them or a name that resolves only into them; empty: any host
    worker_networks: list[str] = Field(default_factory=list)

    @field_validator("worker_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as e:
                raise ValueError(f"worker_networks: {net!r} is not a network ({e})") from None
        return v


def _with_password(url: str, password: str) -> str:
    """``url`` (redis:// or rediss://) with ``password`` as its AUTH password, unless it has
    one or ``password`` is empty."""
    parts = urllib.parse.urlsplit(url)
    if not password or parts.password is not None or parts.scheme not in ("redis", "rediss"):
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    port = f":{parts.port}" if parts.port is not None else ""
    user = urllib.parse.quote(parts.username or "", safe="")
    netloc = f"{user}:{urllib.parse.quote(password, safe='')}@{host}{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class RouterConfig(BaseModel):
    #: unknown keys are an error (a misspelt key would otherwise be ignored without a word):
    #: :func:`parse_config` names the nearest valid key
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: the routing policy: the product's, :data:`PRODUCT_POLICY` (``smetric-global``: SMetric
    #: counting global-tier hits, fetch time and link backlog; docs/router.md), unless a
    #: deployment says otherwise; ``smetric`` is the paper's faithful variant
    policy: str = PRODUCT_POLICY
    policy_params: dict[str, Any] = Field(default_factory=dict)
    #: pd: prefill and decode pools (SGLang's PD hand-off); colocated: one pool whose workers
    #: prefill and decode (no decode list, no bootstrap fields; the policies see each worker's
    #: running decodes); auto: colocated when the config lists prefill workers and no decode
    #: worker, else pd
    mode: Literal["auto", "pd", "colocated"] = "auto"
    hardware: str = "h20"
    slo: SLOConfig = Field(default_factory=SLOConfig)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    admin_token_env: str = "SMETRIC_ADMIN_TOKEN"
    health_interval_s: float = Field(2.0, gt=0)
    #: real SGLang's ``/health`` runs a one-token forward and answers after at least 1 s (its
    #: own verdict, 503, after 20 s): 5 s leaves a busy worker room (docs/deploy.md, "Health")
    health_timeout_s: float = Field(5.0, gt=0)
    #: consecutive failed health checks before a worker is ejected
    health_failures: int = Field(3, ge=1)
    #: an ejected worker is readmitted no sooner than this, and only after a passing check
    eject_cooldown_s: float = Field(5.0, ge=0)
    load_poll: bool = True
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(3.0, gt=0)
    #: tokenization cache bound, in tokens (4 bytes each)
    token_cache_tokens: int = Field(8_000_000, ge=0)
    #: where a request's feature work runs (stack/prefill_router/offload.py): bodies under
    #: ``feature_inline_bytes`` on the event loop; under ``feature_attempt_bytes`` on the loop
    #: when their text not in the token cache is at most ``feature_budget_chars``, else in the
    #: pool; larger bodies in the pool, of ``feature_threads`` threads
    feature_inline_bytes: int = Field(16 * 1024, ge=0)
    feature_attempt_bytes: int = Field(512 * 1024, ge=0)
    feature_budget_chars: int = Field(8 * 1024, ge=0)
    feature_threads: int = Field(2, ge=1)
    #: seconds a request's feature work may wait for a pool thread before it starts (null:
    #: unbounded); past them the overload answer with ``Retry-After``, as past the dispatch
    #: queue's ``max_queue_wait_s``. 10 s: ten times the SLO's fixed part (``slo.b``), far past
    #: the 0.1-0.3 s a cold 100k-token prompt takes to tokenize, so it only fires when the
    #: router's CPU is saturated (chosen so, not tuned on a result)
    feature_wait_s: float | None = Field(10.0, gt=0)
    #: approximate prefix index (routing history) for workers without KV events
    approx_ttl_s: float = Field(300.0, gt=0)
    approx_capacity_tokens: int = Field(200_000, ge=0)
    #: global tier: "none", "written" (index of what was routed/stored), "mooncake" (existence
    #: checks of HiCache's keys in the Mooncake store), "lmcache" (the LMCache controller's
    #: lookup, ``lmcache_controller_url``; stack/kv_tier/lmcache_view.py)
    global_tier: str = "written"
    #: the LMCache controller (``lmcache_controller``) the "lmcache" global tier asks
    lmcache_controller_url: str | None = None
    #: LMCache's chunk (its hits are whole chunks)
    lmcache_chunk_size: int = Field(256, ge=1)
    global_capacity_tokens: int = Field(50_000_000, ge=0)
    #: prefix of the workers' global-tier keys (the worker's store_key_prefix)
    global_key_prefix: str = ""
    #: budget of one batched existence check on the routing path
    global_check_timeout_s: float = Field(0.02, gt=0)
    fetch_tokens_per_s: float = Field(200_000.0, ge=0)
    #: how the workers share global-tier links, for the link backlog the router books
    #: (docs/router.md, "The link backlog"): "worker", a link (NIC) each; "host", one per
    #: host, shared by the workers on it
    link: Literal["worker", "host"] = "worker"
    retry_after_s: int = Field(1, ge=0)
    #: a streamed request whose answer has not started this many seconds after it left the
    #: dispatch queue gets its 200 and an SSE comment (``: keep-alive``) every as many seconds
    #: until its first token, so that a proxy's idle timeout (often 60 s) does not cut a long
    #: prefill (stack/prefill_router/api/keepalive.py); None: off
    stream_keepalive_s: float | None = Field(15.0, gt=0)
    #: a draining replica (SIGTERM, ``POST /admin/drain``; stack/prefill_router/drain.py) exits
    #: no sooner than this after the drain began, so load balancers' probes see its 503
    drain_notice_s: float = Field(2.0, ge=0)
    #: and no later than this (what is still in flight then is cut); None: request_timeout_s
    drain_timeout_s: float | None = Field(None, gt=0)
    #: wall seconds per second of the pool's own time: 1 for real engines; an emulated pool
    #: runs its modelled GPU clock at ``launch.emulator.time_factor`` (`smetric up` copies it
    #: here), and the router's clock for deadlines, queue waits and TTFT feedback reads
    #: wall / time_factor, so that they are in the same seconds as the SLO and the cost model
    time_factor: float = Field(1.0, gt=0)
    #: the dispatch queue (docs/router.md, Dispatch queue; the study: docs/dispatch.md): the
    #: section is a :class:`~stack.dispatch.DispatchSpec` over the router's default
    #: (:data:`~stack.dispatch.ROUTER_DISPATCH`: deadline-defer, readiness from the traffic's
    #: SLOs; what the section leaves out keeps the default's value); order immediate: no queue
    dispatch: DispatchSpec = ROUTER_DISPATCH
    #: OpenTelemetry spans and traceparent propagation (off by default)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    record: RecordConfig = Field(default_factory=RecordConfig)
    log_level: str = "info"
    #: API keys and per-key limits on the client endpoints; the workers' keys
    auth: AuthConfig = Field(default_factory=AuthConfig)
    #: the cost model: static | observe | learn (CostModelConfig; a mapping for its bounds)
    cost_model: CostModelConfig = Field(default_factory=CostModelConfig)
    #: limits on client connections before a request reaches the app (FrontDoorConfig)
    front_door: FrontDoorConfig = Field(default_factory=FrontDoorConfig)
    #: the model names requests may carry; others get 404 (ModelNamesConfig)
    models: ModelNamesConfig = Field(default_factory=ModelNamesConfig)
    #: the admin API's limits: the networks workers may be added in (AdminConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    #: router replicas: Redis shared by the replicas in front of one pool (e.g.
    #: redis://host:6379/0); None: a single router on its own state (docs/router.md, Replicas)
    redis_url: str | None = None
    #: env var holding the Redis password (``requirepass``; a Kubernetes Secret, or the one the
    #: launcher generates for a Redis bound beyond loopback: docs/deploy.md, "Router replicas"):
    #: when it is set, the router connects to ``redis_url`` with it (a password already in the URL
    #: wins); unset, the URL is used as it is
    redis_password_env: str | None = None
    #: key prefix in Redis; replicas of one pool share it, other pools use another
    redis_namespace: str = "smetric"
    #: this replica's id (default: hostname-pid-random)
    replica_id: str | None = None
    #: budget of one Redis call; a failure marks shared state down (local state only) until
    #: a background reconnect succeeds and resyncs
    redis_timeout_s: float = Field(0.1, gt=0)
    #: heartbeat period, and the TTL after which a silent replica's figures are ignored
    redis_heartbeat_s: float = Field(0.5, gt=0)
    redis_ttl_s: float = Field(2.0, gt=0)
    #: period of publishing completions (bookings are published at once)
    redis_flush_s: float = Field(0.05, gt=0)
    #: with redis_url: the replicas share the token ids of the prompt segments they tokenize
    #: (segments of at least redis_token_min_chars characters; each key expires
    #: redis_token_ttl_s after its last write), so a turn on a replica that missed the
    #: previous ones is not tokenized again (stack.prefill_router.shared_tokens)
    redis_token_cache: StrictBool = True
    redis_token_ttl_s: float = Field(600.0, gt=0)
    redis_token_min_chars: int = Field(1024, ge=1)

    @field_validator("cost_model", mode="before")
    @classmethod
    def _cost_model(cls, v: Any) -> Any:
        return {"mode": v} if isinstance(v, str) else v

    @field_validator("dispatch", mode="before")
    @classmethod
    def _dispatch(cls, v: Any) -> Any:
        """The section over the router's default (a spec given whole is taken as it is)."""
        return DispatchSpec.from_config(v) if isinstance(v, Mapping) else v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix:// (got {v!r})")
        return v or None

    @model_validator(mode="after")
    def _redis_password(self):
        """``redis_url`` with the password of ``redis_password_env`` (read from the environment
        when the config is parsed, at the router's start)."""
        if self.redis_url and self.redis_password_env:
            self.redis_url = _with_password(self.redis_url, os.environ.get(self.redis_password_env, ""))
        return self

    @model_validator(mode="after")
    def _redis_timing(self):
        # a TTL within two beats lets a healthy replica's own heartbeat expire between beats
        if self.redis_ttl_s <= 2 * self.redis_heartbeat_s:
            raise ValueError(
                f"redis_ttl_s ({self.redis_ttl_s}) must exceed twice redis_heartbeat_s ({self.redis_heartbeat_s})"
            )
        return self


class PrefillWorkerConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str
    bootstrap_port: int | None = 8998
    kv_events: str | None = None  # e.g. tcp://127.0.0.1:5557
    kv_topic: str = "kv"
    #: the worker's KV-event replay endpoint (SGLang's ``replay_endpoint``, e.g.
    #: tcp://127.0.0.1:5558): a sequence gap, or a router started after the worker, is
    #: recovered from its last 10,000 batches instead of dropping the worker's index
    kv_replay: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)


class DecodeWorkerConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)


class MooncakeConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    master: str | None = None
    metadata_url: str | None = None


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: ModelConfig = Field(default_factory=ModelConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: list[PrefillWorkerConfig] = Field(default_factory=list)
    decode: list[DecodeWorkerConfig] = Field(default_factory=list)
    mooncake: MooncakeConfig | None = None
    launch: dict[str, Any] | None = None

    @property
    def colocated(self) -> bool:
        """Whether the router serves a colocated pool (``router.mode``)."""
        m = self.router.mode
        return m == "colocated" or (m == "auto" and bool(self.prefill) and not self.decode)

    @model_validator(mode="after")
    def _mode(self):
        if self.router.mode == "colocated" and self.decode:
            raise ValueError("router.mode colocated takes no decode workers (remove the decode list)")
        return self


def _check_url(v: str) -> str:
    v = v.strip().rstrip("/")
    if not (v.startswith("http://") or v.startswith("https://")):
        raise ValueError(f"worker url must start with http:// or https:// (got {v!r})")
    return v


def load_config(path: str | Path) -> DeploymentConfig:
    """Load and validate a deployment YAML. Raises ``ValueError`` with a readable message."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: invalid YAML: {e}") from None
    return parse_config(data, source=str(p))


def parse_config(data: dict, source: str = "config") -> DeploymentConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: top level must be a mapping")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: invalid deployment config:"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {_message(err)}")
        raise ValueError("\n".join(lines)) from None


def _message(err: Any) -> str:
    """A validation error's message; an unknown key's names the nearest valid one."""
    if err.get("type") != "extra_forbidden":
        return err["msg"]
    *parent, key = err["loc"]
    model: Any = DeploymentConfig
    for part in parent:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        sub = getattr(field, "annotation", None) if field else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return f"unknown key {key!r}"
        model = sub
    near = difflib.get_close_matches(str(key), list(model.model_fields), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unknown key {key!r}{hint}"
