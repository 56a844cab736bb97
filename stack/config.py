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

Every key's description is in its model (``Field(description=...)``); ``launch``'s keys are
documented by :class:`LaunchConfig`, which validates nothing. docs/reference/configuration.md is
generated from them (``python -m stack.reference``).
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

    name: str = Field(
        "default",
        description=(
            "the served model's name: what ``/v1/models`` lists first, what a request's ``model`` is checked "
            "against (``router.models``), and the launched workers' ``--served-model-name`` unless "
            "``launch.served_model_name`` says otherwise"
        ),
    )
    path: str | None = Field(None, description="local model dir (tokenizer.json + tokenizer_config.json)")
    page_size: int = Field(
        64,
        ge=1,
        description=(
            "tokens per KV page (SGLang's ``--page-size``): the block size of the router's prefix index and "
            "of the prompt hashes it routes on"
        ),
    )
    context_length: int = Field(
        131072,
        ge=1,
        description=(
            "the model's context length in tokens: a longer prompt is refused (400, "
            "``context_length_exceeded``) before it is routed; ``/model_info`` reports it as "
            "``max_model_len``"
        ),
    )
    tool_call_parser: str | None = Field(
        None,
        description=(
            "SGLang's ``--tool-call-parser`` for this model's call format (``qwen3_coder`` for Qwen3-Coder): "
            "without it a worker answers a tool call as plain text and an agent's tool turn breaks. Both "
            "launchers give it to every worker (real SGLang and the emulator)"
        ),
    )
    reasoning_parser: str | None = Field(
        None,
        description=(
            "SGLang's ``--reasoning-parser``, only for a model that thinks (Qwen3-Coder does not); real "
            "SGLang workers only (the emulator does not think)"
        ),
    )


class SLOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    b: float = Field(
        1.0,
        ge=0,
        description=(
            "the TTFT SLO's fixed part, in seconds: a request's SLO is ``b + a_per_1k x prompt tokens / "
            "1000``"
        ),
    )
    a_per_1k: float = Field(0.0625, ge=0, description="seconds per 1k prompt tokens")


class AuthConfig(BaseModel):
    """``router.auth``: API keys on the client endpoints with per-key limits
    (:mod:`stack.prefill_router.auth`; docs/deploy/security.md, "API keys and limits"), and the keys the
    router sends to workers started with SGLang's ``--api-key`` / ``--admin-api-key``.

    Client keys are on when ``keys_file`` or ``keys_env`` is set: a YAML (or JSON) mapping
    ``{keys: [{name, key | sha256, requests_per_s, request_burst, prompt_tokens_per_s,
    prompt_token_burst, max_concurrency}], defaults: {...limits}}``, read at start (a file or
    variable that cannot be read stops the router) and again on ``POST /admin/auth/reload``."""

    model_config = ConfigDict(extra="forbid")

    keys_file: str | None = Field(
        None,
        description="the keys file (hashes preferred: ``sha256: <hex of the key>``; plaintext ``key:`` too)",
    )
    keys_env: str | None = Field(
        None,
        description="an env var holding the same YAML/JSON text (e.g. from a Kubernetes Secret)",
    )
    protect_metrics: StrictBool = Field(
        False,
        description=(
            "``/metrics`` needs a valid key too (default: open, as SGLang leaves it, for scrapers; "
            "``/health`` is always open, for probes)"
        ),
    )
    max_key_bytes: int = Field(
        1024,
        ge=16,
        le=65536,
        description="the longest key header accepted (longer: 431, before any hashing)",
    )
    worker_api_key_env: str | None = Field(
        None,
        description=(
            "env var with the key the router sends workers started with SGLang's ``--api-key`` "
            "(``Authorization: Bearer``, on hand-offs, health checks and load polls)"
        ),
    )
    worker_admin_api_key_env: str | None = Field(
        None,
        description=(
            "env var with the workers' ``--admin-api-key``: SGLang accepts only it on ``/abort_request`` "
            "once set, so without it the router's aborts would be refused"
        ),
    )

    @property
    def enabled(self) -> bool:
        """Whether client keys are required."""
        return bool(self.keys_file or self.keys_env)


class TracingConfig(BaseModel):
    """OpenTelemetry tracing of the router (``router.tracing``; docs/operate/monitoring.md, "Tracing").

    ``enabled: false`` (the default): no tracer, no span and no ``traceparent`` header. ``enabled:
    true``: each sampled request gets spans (receive, parse, queue wait, route, prefill, decode,
    first token, stream) and both PD workers get a W3C ``traceparent`` naming the router's span,
    so SGLang's own spans (``--enable-trace``) join the trace; a client's ``traceparent`` is
    continued. The spans are exported over OTLP only when ``endpoint`` is set."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = Field(
        False,
        description="spans for sampled requests and ``traceparent`` headers to the workers (false: no tracer at all)",
    )
    endpoint: str | None = Field(
        None,
        description=(
            "OTLP collector: http/protobuf ``http://host:4318/v1/traces`` (``/v1/traces`` is added to an "
            "endpoint without a path), gRPC ``http://host:4317``; None: spans are not exported"
        ),
    )
    protocol: Literal["http/protobuf", "grpc"] = Field(
        "http/protobuf",
        description="the OTLP protocol of ``endpoint``",
    )
    sampling_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of new traces sampled (a client's sampled flag is followed as it comes)",
    )
    service_name: str = Field("smetric-router", description="the ``service.name`` of the router's spans")
    export_timeout_s: float = Field(10.0, gt=0, description="seconds one OTLP export may take")

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

    enabled: StrictBool = Field(False, description="record what the router serves")
    dir: str = Field(
        "smetric-record",
        description="where the files go (one series per router replica: ``record-<replica>-<n>.jsonl``)",
    )
    salt_env: str = Field(
        "SMETRIC_RECORD_SALT",
        description=(
            "environment variable holding the salt the block ids are keyed with; every replica of a "
            "deployment must get the same one for their files to merge. Unset or empty: a random salt kept "
            "in ``<dir>/salt`` (mode 0600), which replicas sharing the directory share"
        ),
    )
    block_tokens: int = Field(
        64,
        ge=1,
        description="tokens per recorded block: a multiple of ``model.page_size`` (64: the agentic traces')",
    )
    rotate_bytes: int = Field(
        64 << 20,
        ge=4096,
        description="a file is closed and a new one begun past this size",
    )
    max_bytes: int = Field(
        1 << 30,
        ge=4096,
        description="the directory's recordings are kept under this size: the oldest files go first",
    )
    queue: int = Field(
        10_000,
        ge=1,
        description="requests waiting for the writer; past it a request is not recorded (counted)",
    )


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

    mode: Literal["static", "observe", "learn"] = Field(
        "static",
        description=(
            "static: price with ``router.hardware``; observe: also fit the pool's own cost model and export "
            "it; learn: also price with the fitted model while it is trustworthy"
        ),
    )
    buffer: int = Field(
        2000,
        ge=10,
        description=(
            "observations kept (the newest); the fit uses lone prefills and busy stretches (chains of "
            "overlapping prefills on one worker, each fitted as one row: docs/calibrate.md)"
        ),
    )
    min_observations: int = Field(
        40,
        ge=5,
        description="trust: at least this many fitted rows (lone prefills or busy stretches) ...",
    )
    min_span: float = Field(
        4.0,
        ge=1,
        description="... whose new-token counts span at least this ratio (largest / smallest) ...",
    )
    max_mape: float = Field(
        0.15,
        gt=0,
        description="... a held-out error (MAPE, one row in each holdout_every) at most this ...",
    )
    holdout_every: int = Field(
        5,
        ge=2,
        description=(
            "one row in each holdout_every is held out of the fit to measure its error (``max_mape``); its "
            "place in the block varies from block to block, so periodic traffic is not held out at one size"
        ),
    )
    max_c_linear: float = Field(
        1e-2,
        gt=0,
        description="... and coefficients within these bounds (seconds per token, per token^2, per forward)",
    )
    max_c_attn: float = Field(
        1e-6,
        gt=0,
        description="trust: the largest coefficient per token^2, in seconds",
    )
    max_c_fwd: float = Field(5.0, gt=0, description="trust: the largest coefficient per forward, in seconds")
    refit_every: int = Field(
        10,
        ge=1,
        description="refit after this many new observations (or every 1/20 of those held, if more)",
    )
    max_queue_s: float = Field(
        0.005,
        ge=0,
        description=(
            "a stretch whose first prefill queued longer than this (and not behind the worker's previous "
            "stretch) began behind unseen work: not fitted"
        ),
    )


class FrontDoorConfig(BaseModel):
    """``router.front_door``: what one client connection may hold of the router before its
    request reaches the app (:mod:`stack.prefill_router.front_door`; docs/router.md, "The front
    door"). Checked on the bytes as they arrive, before the HTTP parser sees them."""

    model_config = ConfigDict(extra="forbid")

    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="the largest request head (request line and headers), in bytes; over it: 431, closed",
    )
    max_headers: int = Field(
        100,
        ge=8,
        description="the most header lines one request may carry; over it: 431, closed",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "seconds from a connection's start (or a kept-alive connection's next request's first byte) to "
            "the end of the request's headers; over it: 408, closed"
        ),
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "seconds from the end of the headers to the end of the body; over it: 408 in the API's shape, "
            "closed (the request is counted with status 408)"
        ),
    )
    keep_alive_s: float = Field(
        20.0,
        gt=0,
        description=(
            "seconds an idle kept-alive connection stays open (longer than common clients' own idle expiry, "
            "so that the client closes first)"
        ),
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description=(
            "open client connections; a connection beyond them gets 503 with Retry-After in the API's shape "
            "and is closed (the router raises its open-file limit to fit)"
        ),
    )


class ModelNamesConfig(BaseModel):
    """``router.models``: the ``model`` names a request may carry (docs/router.md, "Model
    names"). Accepted: ``model.name``, the aliases, a name matching a pattern, any of those
    with a LoRA adapter after a colon (SGLang's ``base:adapter``), and a request with no
    ``model``; any other name is answered 404 in the endpoint's API shape."""

    model_config = ConfigDict(extra="forbid")

    aliases: list[str] = Field(
        default_factory=list,
        description="other names of the served model (e.g. the Hugging Face id clients know it by)",
    )
    accept: list[str] = Field(
        default_factory=lambda: ["claude-*"],
        description=(
            "shell-style patterns (``fnmatch``, case-sensitive) of names also accepted: by default the "
            '``claude-*`` names Claude Code sends; ``["*"]`` accepts every name'
        ),
    )


class AdminConfig(BaseModel):
    """``router.admin``: what the admin API may do (docs/router.md, "Admin API")."""

    model_config = ConfigDict(extra="forbid")

    worker_networks: list[str] = Field(
        default_factory=list,
        description=(
            "networks (CIDR, e.g. 10.0.0.0/8) a worker added at run time must be in: its host is an address "
            "in one of them or a name that resolves only into them; empty: any host"
        ),
    )

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

    host: str = Field("127.0.0.1", description="the address the router listens on")
    port: int = Field(8000, ge=0, le=65535, description="the port the router listens on")
    policy: str = Field(
        PRODUCT_POLICY,
        description=(
            "the routing policy: the product's, :data:`PRODUCT_POLICY` (``smetric-global``: SMetric counting "
            "global-tier hits, fetch time and link backlog; docs/router.md), unless a deployment says "
            "otherwise; ``smetric`` is the paper's faithful variant"
        ),
    )
    policy_params: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments given to the routing policy's constructor (stack/policies/)",
    )
    mode: Literal["auto", "pd", "colocated"] = Field(
        "auto",
        description=(
            "pd: prefill and decode pools (SGLang's PD hand-off); colocated: one pool whose workers prefill "
            "and decode (no decode list, no bootstrap fields; the policies see each worker's running "
            "decodes); auto: colocated when the config lists prefill workers and no decode worker, else pd"
        ),
    )
    hardware: str = Field(
        "h20",
        description=(
            "the cost-model calibration the router prices prefills with: a shipped name (``h20``, ``h200``: "
            "configs/hardware/) or the path of a calibration YAML (``smetric calibrate`` writes one)"
        ),
    )
    slo: SLOConfig = Field(
        default_factory=SLOConfig,
        description="the TTFT SLO: ``b`` seconds plus ``a_per_1k`` seconds per 1k prompt tokens",
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description=(
            "the largest request body read, in bytes (inference, tokenize and admin bodies, with or without "
            "a ``Content-Length``); larger: 413"
        ),
    )
    admin_token_env: str = Field(
        "SMETRIC_ADMIN_TOKEN",
        description=(
            "env var holding the admin API's bearer token (``Authorization: Bearer <token>``), read at "
            "start; unset or empty: the admin API answers 401 to every call"
        ),
    )
    health_interval_s: float = Field(
        2.0,
        gt=0,
        description="seconds between two health checks (and load polls) of each worker",
    )
    health_timeout_s: float = Field(
        5.0,
        gt=0,
        description=(
            "seconds a health check may take: real SGLang's ``/health`` runs a one-token forward and answers "
            "after at least 1 s (its own verdict, 503, after 20 s): 5 s leaves a busy worker room "
            '(docs/deploy/bare-metal.md, "Health and readiness")'
        ),
    )
    health_failures: int = Field(
        3,
        ge=1,
        description="consecutive failed health checks before a worker is ejected",
    )
    eject_cooldown_s: float = Field(
        5.0,
        ge=0,
        description="an ejected worker is readmitted no sooner than this, and only after a passing check",
    )
    load_poll: bool = Field(
        True,
        description="poll each worker's load (SGLang's ``/get_load``) with its health checks",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "seconds a request to a worker may take; also the deadline of a drain (a replica's, a worker's) "
            "when ``drain_timeout_s`` is unset"
        ),
    )
    connect_timeout_s: float = Field(
        3.0,
        gt=0,
        description="seconds a connection to a worker may take to open",
    )
    token_cache_tokens: int = Field(
        8_000_000,
        ge=0,
        description="tokenization cache bound, in tokens (4 bytes each)",
    )
    feature_inline_bytes: int = Field(
        16 * 1024,
        ge=0,
        description=(
            "where a request's feature work runs (stack/prefill_router/offload.py): bodies under "
            "``feature_inline_bytes`` on the event loop; under ``feature_attempt_bytes`` on the loop when "
            "their text not in the token cache is at most ``feature_budget_chars``, else in the pool; larger "
            "bodies in the pool, of ``feature_threads`` threads"
        ),
    )
    feature_attempt_bytes: int = Field(
        512 * 1024,
        ge=0,
        description=(
            "bodies under this size (and at least ``feature_inline_bytes``) have their feature work on the "
            "event loop when their text not in the token cache is at most ``feature_budget_chars``, else in "
            "the pool"
        ),
    )
    feature_budget_chars: int = Field(
        8 * 1024,
        ge=0,
        description=(
            "characters not in the token cache that a body under ``feature_attempt_bytes`` may have for its "
            "feature work to run on the event loop"
        ),
    )
    feature_threads: int = Field(
        2,
        ge=1,
        description="threads of the pool that runs the feature work of the larger bodies",
    )
    feature_wait_s: float | None = Field(
        10.0,
        gt=0,
        description=(
            "seconds a request's feature work may wait for a pool thread before it starts (null: unbounded); "
            "past them the overload answer with ``Retry-After``, as past the dispatch queue's "
            "``max_queue_wait_s``. 10 s: ten times the SLO's fixed part (``slo.b``), far past the 0.1-0.3 s "
            "a cold 100k-token prompt takes to tokenize, so it only fires when the router's CPU is saturated "
            "(chosen so, not tuned on a result)"
        ),
    )
    approx_ttl_s: float = Field(
        300.0,
        gt=0,
        description=(
            "seconds a routed prefix stays in the approximate prefix index (routing history) for workers "
            "without KV events"
        ),
    )
    approx_capacity_tokens: int = Field(
        200_000,
        ge=0,
        description="capacity of each worker's approximate prefix index, in tokens (0: no routing history kept)",
    )
    global_tier: str = Field(
        "written",
        description=(
            'global tier: "none", "written" (index of what was routed/stored), "mooncake" (existence checks '
            "of HiCache's keys in the Mooncake store), \"lmcache\" (the LMCache controller's lookup, "
            "``lmcache_controller_url``; stack/kv_tier/lmcache_view.py)"
        ),
    )
    lmcache_controller_url: str | None = Field(
        None,
        description='the LMCache controller (``lmcache_controller``) the "lmcache" global tier asks',
    )
    lmcache_chunk_size: int = Field(256, ge=1, description="LMCache's chunk (its hits are whole chunks)")
    global_capacity_tokens: int = Field(
        50_000_000,
        ge=0,
        description="capacity of the ``written`` global tier's index, in tokens",
    )
    global_key_prefix: str = Field(
        "",
        description="prefix of the workers' global-tier keys (the worker's store_key_prefix)",
    )
    global_check_timeout_s: float = Field(
        0.02,
        gt=0,
        description="budget of one batched existence check on the routing path",
    )
    fetch_tokens_per_s: float = Field(
        200_000.0,
        ge=0,
        description=(
            "tokens per second one link fetches from the global tier: prices a global-tier hit's fetch time "
            "and the link backlog (0: global-tier hits are not priced)"
        ),
    )
    link: Literal["worker", "host"] = Field(
        "worker",
        description=(
            "how the workers share global-tier links, for the link backlog the router books (docs/router.md, "
            '"The link backlog"): "worker", a link (NIC) each; "host", one per host, shared by the workers '
            "on it"
        ),
    )
    retry_after_s: int = Field(
        1,
        ge=0,
        description=(
            "seconds in the ``Retry-After`` header of the overload answers (no worker, a draining replica, "
            "the front door's connection limit, a key over its limits; the dispatch queue's may be longer, "
            "at most 60 s)"
        ),
    )
    stream_keepalive_s: float | None = Field(
        15.0,
        gt=0,
        description=(
            "a streamed request whose answer has not started this many seconds after it left the dispatch "
            "queue gets its 200 and an SSE comment (``: keep-alive``) every as many seconds until its first "
            "token, so that a proxy's idle timeout (often 60 s) does not cut a long prefill "
            "(stack/prefill_router/api/keepalive.py); None: off"
        ),
    )
    drain_notice_s: float = Field(
        2.0,
        ge=0,
        description=(
            "a draining replica (SIGTERM, ``POST /admin/drain``; stack/prefill_router/drain.py) exits no "
            "sooner than this after the drain began, so load balancers' probes see its 503"
        ),
    )
    drain_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "a draining replica exits no later than this after the drain began (what is still in flight then "
            "is cut); None: request_timeout_s"
        ),
    )
    time_factor: float = Field(
        1.0,
        gt=0,
        description=(
            "wall seconds per second of the pool's own time: 1 for real engines; an emulated pool runs its "
            "modelled GPU clock at ``launch.emulator.time_factor`` (`smetric up` copies it here), and the "
            "router's clock for deadlines, queue waits and TTFT feedback reads wall / time_factor, so that "
            "they are in the same seconds as the SLO and the cost model"
        ),
    )
    dispatch: DispatchSpec = Field(
        ROUTER_DISPATCH,
        description=(
            "the dispatch queue (docs/router.md, Dispatch queue; the study: docs/research/dispatch.md): the section "
            "is a :class:`~stack.dispatch.DispatchSpec` over the router's default "
            "(:data:`~stack.dispatch.ROUTER_DISPATCH`: deadline-defer, readiness from the traffic's SLOs; "
            "what the section leaves out keeps the default's value); order immediate: no queue"
        ),
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry spans and traceparent propagation (off by default)",
    )
    record: RecordConfig = Field(
        default_factory=RecordConfig,
        description=(
            "a trace of what the router serves, for ``smetric advise`` and the simulator (RecordConfig; off "
            "by default)"
        ),
    )
    log_level: str = Field(
        "info",
        description=(
            "the router's log level (debug, info, warning, error); ``smetric router --log-level`` overrides "
            "it"
        ),
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig,
        description="API keys and per-key limits on the client endpoints; the workers' keys",
    )
    cost_model: CostModelConfig = Field(
        default_factory=CostModelConfig,
        description="the cost model: static | observe | learn (CostModelConfig; a mapping for its bounds)",
    )
    front_door: FrontDoorConfig = Field(
        default_factory=FrontDoorConfig,
        description="limits on client connections before a request reaches the app (FrontDoorConfig)",
    )
    models: ModelNamesConfig = Field(
        default_factory=ModelNamesConfig,
        description="the model names requests may carry; others get 404 (ModelNamesConfig)",
    )
    admin: AdminConfig = Field(
        default_factory=AdminConfig,
        description="the admin API's limits: the networks workers may be added in (AdminConfig)",
    )
    redis_url: str | None = Field(
        None,
        description=(
            "router replicas: Redis shared by the replicas in front of one pool (e.g. redis://host:6379/0); "
            "None: a single router on its own state (docs/router.md, Replicas)"
        ),
    )
    redis_password_env: str | None = Field(
        None,
        description=(
            "env var holding the Redis password (``requirepass``; a Kubernetes Secret, or the one the "
            'launcher generates for a Redis bound beyond loopback: docs/deploy/bare-metal.md, "Router replicas"): when '
            "it is set, the router connects to ``redis_url`` with it (a password already in the URL wins); "
            "unset, the URL is used as it is"
        ),
    )
    redis_namespace: str = Field(
        "smetric",
        description="key prefix in Redis; replicas of one pool share it, other pools use another",
    )
    replica_id: str | None = Field(None, description="this replica's id (default: hostname-pid-random)")
    redis_timeout_s: float = Field(
        0.1,
        gt=0,
        description=(
            "budget of one Redis call; a failure marks shared state down (local state only) until a "
            "background reconnect succeeds and resyncs"
        ),
    )
    redis_heartbeat_s: float = Field(
        0.5,
        gt=0,
        description="heartbeat period, and the TTL after which a silent replica's figures are ignored",
    )
    redis_ttl_s: float = Field(
        2.0,
        gt=0,
        description=(
            "seconds after its last heartbeat that a replica's figures are ignored (more than twice "
            "``redis_heartbeat_s``)"
        ),
    )
    redis_flush_s: float = Field(
        0.05,
        gt=0,
        description="period of publishing completions (bookings are published at once)",
    )
    redis_token_cache: StrictBool = Field(
        True,
        description=(
            "with redis_url: the replicas share the token ids of the prompt segments they tokenize (segments "
            "of at least redis_token_min_chars characters; each key expires redis_token_ttl_s after its last "
            "write), so a turn on a replica that missed the previous ones is not tokenized again "
            "(stack.prefill_router.shared_tokens)"
        ),
    )
    redis_token_ttl_s: float = Field(
        600.0,
        gt=0,
        description="seconds a shared token-cache key lives after its last write",
    )
    redis_token_min_chars: int = Field(
        1024,
        ge=1,
        description="the shortest prompt segment, in characters, whose token ids the replicas share",
    )

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

    url: str = Field(
        description=(
            "the prefill worker's HTTP address (http:// or https://); with ``router.mode`` colocated, a "
            "worker that prefills and decodes"
        ),
    )
    bootstrap_port: int | None = Field(
        8998,
        description=(
            "the worker's PD bootstrap port (SGLang's ``--disaggregation-bootstrap-port``), given to the "
            "decode worker with each request; unused in a colocated pool"
        ),
    )
    kv_events: str | None = Field(
        None,
        description=(
            "the worker's KV-event publisher (ZMQ, e.g. tcp://127.0.0.1:5557) the router subscribes to for "
            "its prefix index; null: the index is built from routing history"
        ),
    )
    kv_topic: str = Field("kv", description="the ZMQ topic of the worker's KV events")
    kv_replay: str | None = Field(
        None,
        description=(
            "the worker's KV-event replay endpoint (SGLang's ``replay_endpoint``, e.g. "
            "tcp://127.0.0.1:5558): a sequence gap, or a router started after the worker, is recovered from "
            "its last 10,000 batches instead of dropping the worker's index"
        ),
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)


class DecodeWorkerConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str = Field(description="the decode worker's HTTP address (http:// or https://)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)


class MooncakeConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    master: str | None = Field(
        None,
        description="the Mooncake master (host:port) that ``router.global_tier: mooncake`` asks for existence checks",
    )
    metadata_url: str | None = Field(
        None,
        description="the Mooncake metadata server's URL (default: ``P2PHANDSHAKE``)",
    )


# -- the ``launch`` section's keys ------------------------------------------------------------
# ``DeploymentConfig.launch`` stays a free-form mapping that the launcher reads itself
# (stack/launch/); these models document the keys it reads, for docs/reference/configuration.md.
# They are not used to validate a config (unknown keys stay allowed). ``shown_default`` (in
# json_schema_extra): the default as the reference shows it, where it depends on the engine or
# the pool, or where the launcher fills it in.


def _shown(text: str) -> dict[str, Any]:
    return {"shown_default": text}


class LaunchPoolConfig(BaseModel):
    """``launch.prefill`` / ``launch.decode``: one pool of workers."""

    model_config = ConfigDict(extra="allow")

    count: int | None = Field(
        None,
        description="instances in the pool",
        json_schema_extra=_shown("prefill 4, decode 2 (emulate); 1 (sglang)"),
    )
    port: int | None = Field(
        None,
        description="HTTP port of the first instance (on each node, under sglang); each next one: + port_stride",
        json_schema_extra=_shown("prefill 30000, decode 31000"),
    )
    port_stride: int = Field(10, description="the step between two instances' ports (every port of the pool)")
    bootstrap_port: int = Field(
        8998,
        description="prefill: PD bootstrap port of the first instance (+ port_stride each)",
    )
    kv_events_port: int | None = Field(
        None,
        description="KV-event (ZMQ) port of the first instance (+ port_stride each); null: no KV events",
        json_schema_extra=_shown("prefill 5557, decode null"),
    )
    kv_events_topic: str = Field("kv", description="the ZMQ topic of the pool's KV events")
    kv_replay_port: int | None = Field(
        None,
        description="KV-event replay port of the first instance (+ port_stride each); null: no replay",
        json_schema_extra=_shown("kv_events_port + 1 when the stride leaves it free, else none"),
    )
    disaggregation: bool = Field(
        True,
        description="prefill: false makes the pool prefill and decode (colocated, no decode pool)",
    )
    workers_per_process: int = Field(
        1,
        description=(
            "emulate: workers sharing one process and event loop (each still its own endpoint, KV-event "
            "publisher and Mooncake clients)"
        ),
    )
    tp: int = Field(1, description="sglang: GPUs (tensor parallelism) of each instance")
    nodes: list[str] | None = Field(
        None,
        description="sglang: the nodes the instances are placed on, in order (default: every node)",
    )
    per_node: int | None = Field(
        None,
        description="sglang: at most this many instances of the pool on one node",
        json_schema_extra=_shown("none; 1 on device cpu"),
    )
    transfer_backend: str = Field(
        "mooncake",
        description="sglang: the PD transfer backend (mooncake, mooncake_tcp, nixl)",
    )
    page_size: int | None = Field(
        None, description="sglang: SGLang's ``--page-size``", json_schema_extra=_shown("model.page_size")
    )
    context_length: int | None = Field(
        None,
        description="sglang: SGLang's ``--context-length``",
        json_schema_extra=_shown("model.context_length"),
    )
    chunked_prefill_size: int | None = Field(
        None,
        description="sglang: SGLang's ``--chunked-prefill-size`` (null: SGLang's default)",
    )
    mem_fraction_static: float | None = Field(
        None,
        description="sglang: SGLang's ``--mem-fraction-static`` (null: SGLang's default)",
    )
    max_total_tokens: int | None = Field(
        None,
        description="sglang: SGLang's ``--max-total-tokens`` (null: SGLang's default)",
    )
    metrics: bool = Field(True, description="sglang: SGLang's ``--enable-metrics``")
    hicache: dict[str, Any] | None = Field(
        None,
        description=(
            "sglang: SGLang's HiCache; a mapping turns it on unless it says ``enabled: false`` (e.g. "
            "``ratio``, ``storage_backend``, ``write_policy``)"
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="sglang: arguments appended verbatim to each instance's command line",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="sglang: environment of the pool's processes",
    )


class LaunchRouterConfig(BaseModel):
    """``launch.router``: the router processes (``false``: none is started)."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = Field(True, description="start the router")
    replicas: int | None = Field(
        None,
        description="router processes: replica i listens on router.port + i (or ports[i]) with "
        "``--replica-id r{i}``, all on one Redis",
        json_schema_extra=_shown("the length of ports, else 1"),
    )
    ports: list[int] | None = Field(None, description="one port per replica")
    extra_args: list[str] = Field(
        default_factory=list,
        description="arguments appended to each router's command line",
    )
    node: str | None = Field(
        None, description="sglang: the node the routers run on", json_schema_extra=_shown("the first node")
    )


class LaunchRedisConfig(BaseModel):
    """``launch.redis``: a Redis for the router replicas' shared state, started when set."""

    model_config = ConfigDict(extra="allow")

    port: int = Field(6379, description="the port Redis listens on")
    binary: str = Field("redis-server", description="the Redis server to run")
    extra_args: list[str] = Field(default_factory=list, description="arguments appended to its command line")
    node: str | None = Field(
        None,
        description="sglang: the node Redis runs on",
        json_schema_extra=_shown("the router's node"),
    )
    password: bool | None = Field(
        None,
        description="require a password (beyond loopback it is required: false is refused there)",
        json_schema_extra=_shown("true beyond loopback, else false"),
    )
    password_env: str = Field(
        "SMETRIC_REDIS_PASSWORD",
        description="the env var holding the password (the routers read it too)",
    )
    tls: dict[str, str] | None = Field(
        None,
        description=(
            "TLS: ``{cert_file, key_file, ca_file}``, paths on the Redis node (``ca_file`` also on the "
            "routers' node); the routers then connect with rediss://"
        ),
    )
    auto: bool = Field(False, description="set by ``smetric up`` on the Redis it adds for router replicas")


class LaunchMooncakeMasterConfig(BaseModel):
    """``launch.mooncake_master``: the Mooncake master of the global tier (null or false: none)."""

    model_config = ConfigDict(extra="allow")

    rpc_port: int = Field(50051, description="the master's RPC port")
    http_metadata_port: int = Field(8080, description="the master's HTTP metadata server port")
    metrics_port: int = Field(9003, description="the master's metrics port")
    binary: str = Field("mooncake_master", description="the master to run")
    extra_args: list[str] = Field(default_factory=list, description="arguments appended to its command line")
    node: str | None = Field(
        None, description="sglang: the node the master runs on", json_schema_extra=_shown("the first node")
    )


class LaunchNodeConfig(BaseModel):
    """One of ``launch.nodes``: a machine of a real-SGLang deployment."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(description="the node's name, as pools' ``nodes`` name it")
    host: str | None = Field(None, description="its address", json_schema_extra=_shown("the name"))
    gpus: int | list[int] = Field(8, description="its GPUs: a count, or the GPU ids to use")
    ib_devices: list[str] | str = Field(
        default_factory=list,
        description="its RDMA NICs, in GPU order (a list, or comma-separated)",
    )


class LaunchPrometheusConfig(BaseModel):
    """``launch.prometheus``: a Prometheus beside the local stack (``smetric up --prometheus``)."""

    model_config = ConfigDict(extra="allow")

    enabled: bool = Field(True, description="start Prometheus")
    port: int = Field(9090, description="its port (a free one with ``ports: auto``)")
    scrape_interval_s: float = Field(5.0, description="seconds between two scrapes")
    binary: str = Field("prometheus", description="the Prometheus to run")


class LaunchK8sConfig(BaseModel):
    """``launch.k8s``: the Kubernetes manifests (stack/launch/k8s.py; docs/deploy/kubernetes.md)."""

    model_config = ConfigDict(extra="allow")

    namespace: str = Field("smetric", description="the namespace of every object")
    image: str = Field("lmsysorg/sglang:v0.5.23-cu130", description="the SGLang workers' image")
    router_image: str = Field(
        "smetric/stack:latest",
        description="the router's image (deploy/image/Containerfile)",
    )
    mooncake_image: str | None = Field(
        None, description="the Mooncake master's image", json_schema_extra=_shown("image")
    )
    lmcache_image: str | None = Field(
        None, description="the LMCache controller's image", json_schema_extra=_shown("image")
    )
    redis_image: str = Field("redis:7", description="the Redis image")
    python: str = Field("python3", description="the interpreter in the worker image")
    model_host_path: str | None = Field(None, description="a hostPath mounted at the model's directory")
    model_pvc: str | None = Field(
        None,
        description="a PersistentVolumeClaim mounted at the model's directory",
    )
    rdma_resource: str | None = Field(
        None,
        description="the RDMA device plugin's resource each worker pod requests (e.g. ``rdma/hca``)",
    )
    rdma_per_pod: int | None = Field(
        None,
        description="how many of rdma_resource a pod requests",
        json_schema_extra=_shown("the pool's tp"),
    )
    host_network: bool = Field(
        False,
        description="worker pods on the host network (only when one pod fills a node's GPUs)",
    )
    gpus_per_node: int = Field(8, description="GPUs per node (checks host_network)")
    shm_size: str = Field("32Gi", description="the workers' /dev/shm size")
    node_selector: dict[str, Any] | None = Field(
        None,
        description="the worker pods' nodeSelector: one mapping for both pools, or one per pool under "
        "``prefill`` / ``decode``",
    )
    service_type: str = Field("ClusterIP", description="the router Service's type")
    secret: str = Field(
        "smetric-keys",
        description="the Secret holding the admin token, Redis password and worker keys",
    )
    keys_secret: str = Field(
        "smetric-client-keys",
        description="the Secret holding the client keys file (``keys.yaml``)",
    )
    redis_tls_secret: str = Field("smetric-redis-tls", description="the Secret holding Redis's TLS files")
    resources: dict[str, Any] | None = Field(
        None,
        description="CPU and memory requests by component, replacing the defaults (k8s.RESOURCES)",
    )
    router_prestop_s: float = Field(
        15,
        description="seconds the router's preStop waits, so that load balancers stop sending first",
    )
    router_termination_grace_s: float | None = Field(
        None,
        description="the router pod's termination grace",
        json_schema_extra=_shown("router_prestop_s plus the drain's deadline"),
    )


class LaunchConfig(BaseModel):
    """``launch``: how ``smetric up`` (engine emulate), the real-SGLang launcher and the Kubernetes
    renderer (engine sglang) start the deployment. Read by stack/launch/ from the raw mapping;
    this model documents its keys (the router never validates the section)."""

    model_config = ConfigDict(extra="allow")

    engine: Literal["emulate", "sglang"] = Field(
        "emulate",
        description=(
            "emulate: CPU-emulated workers on this machine (stack/launch/emulated.py); sglang: real SGLang "
            "workers on the nodes (stack/launch/sglang.py)"
        ),
    )
    run_dir: str = Field(
        ".smetric/run",
        description="where the launcher keeps its run state, logs and the router's resolved config",
    )
    bind_host: str | None = Field(
        None,
        description="the address the launched processes bind",
        json_schema_extra=_shown(
            "127.0.0.1 (emulate); 0.0.0.0, or 127.0.0.1 when every node is loopback (sglang)"
        ),
    )
    ports: Literal["fixed", "auto"] = Field(
        "fixed",
        description="auto: every port of the local stack picked free at start",
    )
    prefill: LaunchPoolConfig | None = Field(None, description="the prefill pool")
    decode: LaunchPoolConfig | None = Field(
        None,
        description="the decode pool (count 0, or prefill.disaggregation false: a colocated pool)",
    )
    router: LaunchRouterConfig | Literal[False] | None = Field(None, description="the router processes")
    redis: LaunchRedisConfig | None = Field(
        None,
        description=(
            "a Redis for router replicas (``smetric up`` adds one when router.replicas > 1 and neither this "
            "nor router.redis_url is given)"
        ),
    )
    mooncake_master: LaunchMooncakeMasterConfig | Literal[False] | None = Field(
        None,
        description="the Mooncake master of the global tier; null or false: none",
        json_schema_extra=_shown("emulate: started with the defaults below"),
    )
    mooncake_store: dict[str, Any] | None = Field(
        None,
        description=(
            "the workers' Mooncake store (emulate: ``global_segment_bytes``; sglang: ``protocol``, "
            "``metadata_server``, ``global_segment_size``, ``local_buffer_size``, ``device_from_ib``)"
        ),
    )
    kv_tier: Literal["hicache", "lmcache"] = Field(
        "hicache",
        description="the workers' KV tier: SGLang's HiCache, or LMCache (``launch.lmcache``; docs/research/lmcache.md)",
    )
    lmcache: dict[str, Any] | None = Field(
        None,
        description=(
            "LMCache's settings with ``kv_tier: lmcache``, its ``controller`` among them "
            "(stack/launch/lmcache_tier.py, stack/launch/emulated_lmcache.py)"
        ),
    )
    emulator: dict[str, Any] | None = Field(
        None,
        description=(
            "emulate: the emulated workers' settings (fields of stack.worker.settings.WorkerSettings, e.g. "
            "``time_factor``)"
        ),
    )
    sglang: dict[str, Any] | None = Field(
        None,
        description=(
            "the workers' ``api_key_env`` / ``admin_api_key_env`` (env vars holding their ``--api-key`` / "
            "``--admin-api-key``) and ``priority_scheduling`` (default false)"
        ),
    )
    prometheus: LaunchPrometheusConfig | bool | None = Field(
        None,
        description="a Prometheus beside the local stack (``smetric up --prometheus``)",
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "``tiny``: with no model.path, a tiny local tokenizer shared by the router and the emulated "
            "workers"
        ),
    )
    stop_grace_s: float = Field(
        10.0,
        description="seconds between SIGTERM and SIGKILL when processes are stopped",
    )
    supervise: bool = Field(
        True,
        description="restart a launched process that dies (stack/launch/supervise.py)",
    )
    ready_timeout_s: float | None = Field(
        None,
        description="seconds to wait for the processes to be ready",
        json_schema_extra=_shown("60 (emulate), 900 (sglang)"),
    )
    device: Literal["cuda", "cpu"] = Field(
        "cuda",
        description="sglang: cuda, or cpu (the CPU tier's flags and environment)",
    )
    python: str = Field("python3", description="sglang: the interpreter with sglang installed, on every node")
    model_path: str | None = Field(
        None, description="sglang: the model's directory on the nodes", json_schema_extra=_shown("model.path")
    )
    served_model_name: str | None = Field(
        None,
        description="sglang: the workers' ``--served-model-name``",
        json_schema_extra=_shown("model.name"),
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of every launched process")
    extra_args: list[str] = Field(
        default_factory=list,
        description="sglang: arguments appended to every worker's command line",
    )
    nodes: list[LaunchNodeConfig] | None = Field(
        None,
        description="sglang: the machines",
        json_schema_extra=_shown("one loopback node: 8 GPUs, none on device cpu"),
    )
    port_stride: int = Field(10, description="sglang: the port step of a pool that sets none")
    k8s: LaunchK8sConfig | None = Field(
        None,
        description="the Kubernetes manifests (``python -m stack.launch.dry_run CONFIG --k8s OUTDIR``)",
    )


class DeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: ModelConfig = Field(default_factory=ModelConfig, description="the served model")
    router: RouterConfig = Field(default_factory=RouterConfig, description="the prefill router")
    prefill: list[PrefillWorkerConfig] = Field(
        default_factory=list,
        description="the prefill workers (a colocated pool's workers)",
    )
    decode: list[DecodeWorkerConfig] = Field(
        default_factory=list,
        description="the decode workers (none in a colocated pool)",
    )
    mooncake: MooncakeConfig | None = Field(None, description="the Mooncake global tier (optional)")
    launch: dict[str, Any] | None = Field(
        None,
        description=(
            "how ``smetric up``, the real-SGLang launcher and the Kubernetes renderer start the deployment: "
            "owned by the launcher and not validated by the router (unknown keys are kept); its keys: "
            ":class:`LaunchConfig`"
        ),
    )

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
