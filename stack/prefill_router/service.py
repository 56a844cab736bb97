"""The OpenAI-compatible SMetric router (FastAPI on uvicorn): ``smetric router``.

Per request: parse (orjson), derive features (tokens, block hashes, turn, est_hit), fill
a :class:`ClusterView` (queued work, running, local hit per prefill worker; global hit),
ask the configured policy to ``choose``, pick the decode worker, and drive SGLang's PD
hand-off (``stack.decode_router.pd``). A failure before anything was streamed is retried
once on another prefill worker; the failing worker is ejected until its health check
passes again.

Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/generate``, ``/v1/models``,
``/health``, ``/metrics``, and the admin API ``/admin/workers`` (bearer token read from
the env var named by ``router.admin_token_env``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stack.config import DeploymentConfig, load_config, parse_config
from stack.decode_router.balancer import pick_decode
from stack.decode_router.pd import PDForwarder, UpstreamError, make_session
from stack.kv_tier.events import KVEventSubscriber
from stack.kv_tier.global_index import MooncakeExistence, NoGlobalTier, WrittenIndex
from stack.kv_tier.index import PrefixIndex
from stack.prefill_router.cost_model import CostModel, load_hardware
from stack.prefill_router.features import ClientError, FeatureExtractor, Features
from stack.prefill_router.metrics import RouterMetrics
from stack.prefill_router.policies import NoInstanceError, PolicyContext, make_policy
from stack.prefill_router.types import SLO, ClusterView, DecisionKind, InstanceState
from stack.prefill_router.types import Request as PRequest
from stack.prefill_router.workers import HealthChecker, Worker, WorkerRegistry

log = logging.getLogger("stack.router")

_JSON = "application/json"
_LOAD_FRESH_S = 10.0


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None
):
    body = {
        "error": {
            "message": message,
            "type": type_,
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return Response(orjson.dumps(body), status_code=status, media_type=_JSON, headers=headers)


class _NoWorker(Exception):
    pass


@dataclass(slots=True)
class _Routed:
    worker: Worker
    kind: DecisionKind
    local_hit: int
    global_hit: int
    seconds: float
    feedback: object  # the policy's own feedback inputs (Policy.feedback), or None


class RouterState:
    """Everything one router instance holds (created per app)."""

    def __init__(
        self, cfg: DeploymentConfig, transport: httpx.AsyncBaseTransport | None = None, global_checker=None
    ):
        self.cfg = cfg
        rc = cfg.router
        self.block_size = cfg.model.page_size
        try:
            hw = load_hardware(rc.hardware)
            self.cost: CostModel = hw.cost
        except ValueError:
            raise
        self.slo = SLO(b=rc.slo.b, a=rc.slo.a_per_1k / 1000.0)
        self.policy = make_policy(
            rc.policy, PolicyContext(self.cost, self.slo, self.block_size), **rc.policy_params
        )
        self.policy_name = rc.policy
        self.features = FeatureExtractor(cfg.model.path, self.block_size, rc.token_cache_tokens)
        self.index = PrefixIndex(
            self.block_size,
            approx_ttl_s=rc.approx_ttl_s,
            approx_capacity_blocks=rc.approx_capacity_tokens // self.block_size,
        )
        if rc.global_tier == "mooncake" and global_checker is None:
            global_checker = _connect_mooncake(cfg)
        if rc.global_tier == "none":
            self.global_tier = NoGlobalTier()
        elif rc.global_tier == "mooncake" and global_checker is not None:
            prefix = rc.global_key_prefix
            self.global_tier = MooncakeExistence(
                global_checker,
                key_fn=lambda h: f"{prefix}{h & 0xFFFFFFFFFFFFFFFF:016x}",
                timeout_s=rc.global_check_timeout_s,
            )
        else:
            self.global_tier = WrittenIndex(max(1, rc.global_capacity_tokens // self.block_size))
        self.fetch_tps = rc.fetch_tokens_per_s if rc.global_tier != "none" else 0.0
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(rc.eject_cooldown_s)
        self.registry.on_add.append(self._on_add)
        self.registry.on_remove.append(self._on_remove)
        self.registry.on_eject.append(self._on_eject)
        self.subscribers: dict[int, KVEventSubscriber] = {}
        self.transport = transport
        self.client: httpx.AsyncClient | None = None
        self.session = None
        self.forwarder: PDForwarder | None = None
        self.health: HealthChecker | None = None
        self.shared = None  # SharedState with router.redis_url (router replicas), else None
        if rc.redis_url:
            from stack.prefill_router.shared_state import SharedState

            self.shared = SharedState(
                rc.redis_url,
                self.registry,
                namespace=rc.redis_namespace,
                replica_id=rc.replica_id,
                timeout_s=rc.redis_timeout_s,
                heartbeat_s=rc.redis_heartbeat_s,
                ttl_s=rc.redis_ttl_s,
                flush_s=rc.redis_flush_s,
                metrics_registry=self.metrics.registry,
            )
        self.started = False
        for p in cfg.prefill:
            self.registry.add("prefill", p.url, p.bootstrap_port, p.kv_events, p.kv_topic)
        for d in cfg.decode:
            self.registry.add("decode", d.url)
        self.admin_token = os.environ.get(rc.admin_token_env) or None

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        rc = self.cfg.router
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=60)
        timeout = httpx.Timeout(rc.request_timeout_s, connect=rc.connect_timeout_s)
        kw = {"transport": self.transport} if self.transport is not None else {}
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, **kw)  # health checks, load polls
        self.session = make_session(rc.request_timeout_s, rc.connect_timeout_s)  # the hot path
        self.forwarder = PDForwarder(self.session)
        self.health = HealthChecker(
            self.registry,
            self.client,
            rc.health_interval_s,
            rc.health_timeout_s,
            rc.health_failures,
            rc.load_poll,
            on_tick=self._tick,
        )
        self.health.start()
        self.started = True
        for w in self.registry.role("prefill"):
            self._subscribe(w)
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        if self.shared is not None:
            await self.shared.stop()
        if self.health:
            await self.health.stop()
        for s in list(self.subscribers.values()):
            await s.stop()
        self.subscribers.clear()
        if self.client:
            await self.client.aclose()
        if self.session:
            await self.session.close()

    def _tick(self) -> None:
        self.index.expire()
        self.registry.purge_stale(self.cfg.router.request_timeout_s)

    # -- registry callbacks ---------------------------------------------------------------
    def _on_add(self, w: Worker) -> None:
        if w.role == "prefill":
            self.index.add_worker(w.wid, events=bool(w.kv_events))
            if self.started:
                self._subscribe(w)

    def _on_remove(self, w: Worker) -> None:
        if w.role == "prefill":
            self.index.remove_worker(w.wid)
            self.policy.forget(w.wid)
            s = self.subscribers.pop(w.wid, None)
            if s is not None:
                asyncio.get_running_loop().create_task(s.stop())

    def _on_eject(self, w: Worker) -> None:
        self.metrics.ejections.inc()
        if w.role == "prefill":
            self.policy.forget(w.wid)

    def _subscribe(self, w: Worker) -> None:
        if not w.kv_events or w.wid in self.subscribers:
            return
        wid = w.wid
        label = w.url

        def on_batch(batch, wid=wid, label=label):
            stored = self.index.apply(wid, batch)
            if stored:
                self.global_tier.record_written(stored)
            self.metrics.kv_events.labels(label).inc()

        def on_gap(wid=wid, label=label):
            self.index.drop_worker(wid)
            self.metrics.kv_gaps.labels(label).inc()

        s = KVEventSubscriber(w.kv_events, w.kv_topic, on_batch, on_gap)
        s.start()
        self.subscribers[wid] = s

    # -- routing ------------------------------------------------------------------------
    async def route(self, f: Features, exclude: set[int]) -> _Routed:
        ws = [
            w
            for w in self.registry.workers.values()
            if w.role == "prefill" and w.healthy and w.wid not in exclude
        ]
        if not ws:
            raise _NoWorker()
        bs = self.block_size
        hits = self.index.hits(f.hashes) if f.hashes else {}
        gblocks = await self.global_tier.hit_blocks(f.hashes) if f.hashes else 0
        spt = self.cost.c_linear
        req = PRequest(f.prompt_tokens, f.turn, f.est_hit, f.session_id)
        shared = self.shared
        # router replicas: the other replicas' figures (None: no Redis, or Redis down)
        t_shared = time.monotonic()
        snap = await shared.refresh() if shared is not None else None
        attempt = 0
        while True:
            now = time.monotonic()
            insts = []
            for w in ws:
                qt, qs = w.view_queued(_LOAD_FRESH_S, now, spt)
                insts.append(
                    InstanceState(w.wid, qt, qs, w.view_running(_LOAD_FRESH_S, now), hits.get(w.wid, 0) * bs)
                )
            view = ClusterView(now, insts, gblocks * bs, self.fetch_tps, bs)
            try:
                d = self.policy.choose(req, view)
            except NoInstanceError:
                raise _NoWorker() from None
            w = self.registry.workers.get(d.instance)
            if w is None or w.wid in exclude:  # a policy returned something odd: be safe
                w = ws[0]
            st = next(s for s in insts if s.index == w.wid)
            L = f.prompt_tokens
            own = self.cost.cost(L - st.local_hit, L)
            if snap is not None:
                # book w unless another booking of w won since snap (then choose again on the
                # fresh figures); the caller dispatches locally with no await in between
                attempt += 1
                snap = await shared.claim(
                    w, L - st.local_hit, own, snap, attempt, deadline=t_shared + shared.timeout_s
                )
                if snap is not None:
                    continue
            return _Routed(w, d.kind, st.local_hit, gblocks * bs, own, self.policy.feedback(req, st))


def _connect_mooncake(cfg: DeploymentConfig):
    """A Mooncake store client for existence checks, or None (then the router's own index)."""
    mc = cfg.mooncake
    if mc is None or not mc.master:
        log.warning("global_tier=mooncake but no mooncake.master configured: using the router's own index")
        return None
    try:
        from stack.kv_tier.mooncake_store import MooncakeStore, StoreConfig

        sc = StoreConfig(master=mc.master, metadata=mc.metadata_url or "P2PHANDSHAKE", global_segment_bytes=0)
        return MooncakeStore(sc).connect()
    except Exception as e:  # noqa: BLE001 - optional component
        log.warning("cannot reach the Mooncake store (%s): using the router's own index", type(e).__name__)
        return None


def create_app(
    cfg: DeploymentConfig,
    transport: httpx.AsyncBaseTransport | None = None,
    global_checker=None,
) -> FastAPI:
    state = RouterState(cfg, transport, global_checker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = _RouterApp(
        title="smetric router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.router = state
    rc = cfg.router
    max_body = rc.max_body_bytes

    # -- errors -------------------------------------------------------------------------
    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no route {request.url.path}", "not_found_error", code="not_found")
        if exc.status_code == 405:
            return error_response(
                405, f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed"
            )
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, "invalid request", code="invalid_request")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal router error", "server_error", code="internal_error")

    # -- helpers ------------------------------------------------------------------------
    async def read_json(request: Request) -> dict | Response:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                if int(cl) > max_body:
                    return error_response(
                        413, f"request body over {max_body} bytes", param=None, code="request_too_large"
                    )
            except ValueError:
                return error_response(400, "bad Content-Length", code="invalid_request")
            raw = await request.body()
        else:
            chunks = []
            n = 0
            async for c in request.stream():
                n += len(c)
                if n > max_body:
                    return error_response(
                        413, f"request body over {max_body} bytes", code="request_too_large"
                    )
                chunks.append(c)
            raw = b"".join(chunks)
        if len(raw) > max_body:
            return error_response(413, f"request body over {max_body} bytes", code="request_too_large")
        if not raw:
            return error_response(400, "empty request body", code="invalid_json")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            return error_response(400, f"malformed JSON: {e.msg} at {e.pos}", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", code="invalid_json")
        request.state.raw = raw
        return body

    def check_common(body: dict, native: bool) -> None:
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ClientError("'stream' must be a boolean", param="stream", code="invalid_type")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ClientError("'model' must be a string", param="model", code="invalid_type")
        for key in ("max_tokens", "max_completion_tokens", "n"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ClientError(f"'{key}' must be a non-negative integer", param=key, code="invalid_type")
        for key in ("temperature", "top_p"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
                raise ClientError(f"'{key}' must be a number", param=key, code="invalid_type")
        if native:
            sp = body.get("sampling_params")
            if sp is not None and not isinstance(sp, dict):
                raise ClientError(
                    "'sampling_params' must be an object", param="sampling_params", code="invalid_type"
                )

    async def serve(request: Request, endpoint: str, path: str) -> Response:
        t0 = time.perf_counter()
        body = await read_json(request)
        if isinstance(body, Response):
            state.metrics.requests.labels(endpoint, str(body.status_code)).inc()
            return body
        try:
            if endpoint == "chat":
                check_common(body, False)
                f = state.features.chat(body)
                stream = bool(body.get("stream"))
            elif endpoint == "completions":
                check_common(body, False)
                if "prompt" not in body:
                    raise ClientError(
                        "'prompt' is required", param="prompt", code="missing_required_parameter"
                    )
                f = state.features.prompt(body.get("prompt"), "prompt")
                stream = bool(body.get("stream"))
            else:
                check_common(body, True)
                if body.get("input_ids") is not None:
                    f = state.features.prompt(body["input_ids"], "input_ids")
                elif body.get("text") is not None:
                    f = state.features.prompt(body["text"], "text")
                else:
                    raise ClientError(
                        "'text' or 'input_ids' is required", param="text", code="missing_required_parameter"
                    )
                stream = bool(body.get("stream"))
        except ClientError as e:
            state.metrics.requests.labels(endpoint, str(e.status)).inc()
            return error_response(e.status, e.message, param=e.param, code=e.code)
        ctx = cfg.model.context_length
        if f.prompt_tokens >= ctx:
            state.metrics.requests.labels(endpoint, "400").inc()
            return error_response(
                400,
                f"the prompt has {f.prompt_tokens} tokens, over the model's context length of {ctx}",
                param="messages" if endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        sid = request.headers.get("x-session-token") or body.get("session_id")
        f.session_id = sid if isinstance(sid, str) else None
        return await dispatch(request, endpoint, path, body, f, stream, t0)

    async def dispatch(request, endpoint, path, body, f: Features, stream: bool, t0: float) -> Response:
        reg = state.registry
        fwd = state.forwarder
        exclude_p: set[int] = set()
        exclude_d: set[int] = set()
        has_decode = bool(reg.role("decode"))
        raw = request.state.raw
        attempt = 0

        def no_worker(role: str) -> Response:
            state.metrics.requests.labels(endpoint, "503").inc()
            return error_response(
                503,
                f"no {role} worker available",
                "service_unavailable",
                code="no_worker",
                headers={"Retry-After": str(rc.retry_after_s)},
            )

        while True:
            try:
                r = await state.route(f, exclude_p)
            except _NoWorker:
                return no_worker("prefill")
            dw = None
            if has_decode:
                dw = pick_decode(reg.role("decode"), exclude_d)
                if dw is None:
                    return no_worker("decode")
            pw = r.worker
            new_tokens = f.prompt_tokens - r.local_hit
            # no await between route() and here: with replicas, route() claimed pw in Redis and
            # the claim is covered by this local accounting only from now on
            ticket = reg.dispatch(pw, new_tokens, r.seconds)
            dticket = reg.dispatch(dw, 0, 0.0) if dw is not None else None
            if attempt == 0:
                state.metrics.overhead.observe(time.perf_counter() - t0)
                state.metrics.decisions.labels(state.policy_name, r.kind.value).inc()
                state.metrics.record_hit(f.prompt_tokens, r.local_hit, r.global_hit)

            if f.hashes:  # routing history, for workers that publish no KV events
                state.index.record_routed(pw.wid, f.hashes)

            def prefill_done(pw=pw, ticket=ticket):
                if ticket in pw.queued:
                    reg.prefill_done(pw, ticket)
                    # workers with KV events report what they stored (and wrote through)
                    if f.hashes and not pw.kv_events:
                        state.global_tier.record_written(f.hashes)

            try:
                up = await fwd.forward(path, raw, body, pw, dw, prefill_done, stream=stream)
            except UpstreamError as e:
                reg.finished(pw, ticket)
                if dw is not None:
                    reg.finished(dw, dticket)
                state.metrics.upstream_errors.labels(e.role).inc()
                if e.retryable:
                    reg.mark_failed(e.worker, rc.health_failures, immediate=True)
                    if e.worker.role == "prefill":
                        exclude_p.add(e.worker.wid)
                    else:
                        exclude_d.add(e.worker.wid)
                    exclude_p.add(pw.wid)
                    if attempt == 0:
                        attempt += 1
                        state.metrics.retries.inc()
                        log.warning("%s worker %s failed (%s); retrying", e.role, e.worker.url, e.message)
                        continue
                    state.metrics.requests.labels(endpoint, "502").inc()
                    return error_response(
                        502, f"upstream failure: {e.message}", "upstream_error", code="upstream_error"
                    )
                state.metrics.requests.labels(endpoint, str(e.status)).inc()
                return _passthrough_error(e)
            break

        ttft = time.perf_counter() - t0
        preq = PRequest(f.prompt_tokens, f.turn, f.est_hit, f.session_id)
        if stream:
            state.metrics.ttft.observe(ttft)
            try:
                if r.feedback is not None:
                    state.policy.observe(preq, pw.wid, r.feedback, ttft)
            except Exception:  # a learning policy must never break serving
                log.exception("policy.observe")

            async def gen():
                try:
                    if up.first:
                        yield up.first
                    async for chunk in up.rest:
                        yield chunk
                finally:
                    reg.finished(pw, ticket)
                    if dw is not None:
                        reg.finished(dw, dticket)

            state.metrics.requests.labels(endpoint, "200").inc()
            return StreamingResponse(gen(), media_type=up.content_type or "text/event-stream")
        try:
            parts = [up.first or b""]
            async for chunk in up.rest:
                parts.append(chunk)
        finally:
            reg.finished(pw, ticket)
            if dw is not None:
                reg.finished(dw, dticket)
        ttft = time.perf_counter() - t0
        state.metrics.ttft.observe(ttft)
        state.metrics.requests.labels(endpoint, "200").inc()
        return Response(b"".join(parts), status_code=200, media_type=up.content_type or _JSON)

    # -- OpenAI / SGLang endpoints --------------------------------------------------------
    # The hot paths bypass FastAPI's routing and middleware layers (raw ASGI; ~0.3 ms/request
    # saved); the FastAPI routes below stay for everything else and as documentation.
    hot_paths = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/generate": "generate"}

    async def hot(scope, receive, send) -> None:
        path = scope["path"]
        request = Request(scope, receive)
        try:
            resp = await serve(request, hot_paths[path], path)
        except Exception:
            log.exception("internal error on %s", path)
            resp = error_response(500, "internal router error", "server_error", code="internal_error")
        await resp(scope, receive, send)

    app.hot_paths = frozenset(hot_paths)
    app.hot = hot

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completions", "/v1/completions")

    @app.post("/generate")
    async def generate(request: Request):
        return await serve(request, "generate", "/generate")

    @app.get("/v1/models")
    async def models():
        data = {
            "object": "list",
            "data": [{"id": cfg.model.name, "object": "model", "created": 0, "owned_by": "smetric"}],
        }
        return Response(orjson.dumps(data), media_type=_JSON)

    @app.get("/health")
    async def health():
        p = len(state.registry.role("prefill", healthy_only=True))
        d = len(state.registry.role("decode", healthy_only=True))
        need_d = bool(state.registry.role("decode"))
        ok = p > 0 and (d > 0 or not need_d)
        body = {"status": "ok" if ok else "unavailable", "prefill_healthy": p, "decode_healthy": d}
        if state.shared is not None:  # router replicas: is the Redis shared state reachable
            body["shared_state"] = "up" if state.shared.up else "down"
            body["replica"] = state.shared.rid
        return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type=_JSON)

    @app.get("/metrics")
    async def metrics():
        m = state.metrics
        for w in state.registry.workers.values():
            m.healthy.labels(w.url, w.role).set(1 if w.healthy else 0)
            m.inflight.labels(w.url, w.role).set(w.inflight)
            if w.role == "prefill":
                m.queued_tokens.labels(w.url).set(w.queued_tokens)
                m.queued_seconds.labels(w.url).set(w.queued_seconds)
                m.index_blocks.labels(w.url).set(state.index.blocks(w.wid))
        data, ctype = m.render()
        return Response(data, media_type=ctype)

    # -- admin --------------------------------------------------------------------------
    def authorized(request: Request) -> bool:
        tok = state.admin_token
        if not tok:
            return False
        h = request.headers.get("authorization", "")
        if not h.lower().startswith("bearer "):
            return False
        return secrets.compare_digest(h[7:].strip().encode(), tok.encode())

    def unauthorized() -> Response:
        return error_response(
            401,
            "admin API needs 'Authorization: Bearer <token>' (token from the env var named by router.admin_token_env)",
            "authentication_error",
            code="unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.get("/admin/workers")
    async def admin_list(request: Request):
        if not authorized(request):
            return unauthorized()
        out = []
        for w in state.registry.workers.values():
            d = w.info()
            if w.role == "prefill":
                d["index_blocks"] = state.index.blocks(w.wid)
                d["kv_source"] = "events" if state.index.uses_events(w.wid) else "routing-history"
            out.append(d)
        return Response(orjson.dumps({"workers": out}), media_type=_JSON)

    @app.post("/admin/workers")
    async def admin_add(request: Request):
        if not authorized(request):
            return unauthorized()
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        role = body.get("role", "prefill")
        url = body.get("url")
        if role not in ("prefill", "decode"):
            return error_response(422, "'role' must be prefill or decode", param="role", code="invalid_value")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return error_response(422, "'url' must be an http(s) URL", param="url", code="invalid_value")
        bp = body.get("bootstrap_port", 8998 if role == "prefill" else None)
        if bp is not None and (not isinstance(bp, int) or isinstance(bp, bool) or not 0 < bp < 65536):
            return error_response(
                422, "'bootstrap_port' must be a port number", param="bootstrap_port", code="invalid_value"
            )
        kv = body.get("kv_events")
        if kv is not None and (not isinstance(kv, str) or "://" not in kv):
            return error_response(
                422, "'kv_events' must be a ZMQ endpoint such as tcp://host:5557", param="kv_events"
            )
        try:
            w = state.registry.add(role, url, bp, kv, str(body.get("kv_topic", "kv")))
        except ValueError as e:
            return error_response(409, str(e), code="conflict")
        if state.shared is not None:  # the other replicas pick it up
            await state.shared.registry_add(w)
        log.info("admin: added %s worker %s", role, w.url)
        return Response(orjson.dumps(w.info()), status_code=201, media_type=_JSON)

    @app.delete("/admin/workers")
    async def admin_remove(request: Request):
        if not authorized(request):
            return unauthorized()
        body = await read_json(request)
        if isinstance(body, Response):
            return body
        url = body.get("url")
        role = body.get("role")
        wid = body.get("id")
        target = None
        for w in state.registry.workers.values():
            if (wid is not None and w.wid == wid) or (
                url is not None and w.url == str(url).rstrip("/") and role in (None, w.role)
            ):
                target = w
                break
        if target is None:
            return error_response(404, "no such worker", "not_found_error", code="not_found")
        state.registry.remove(target.wid)
        if state.shared is not None:
            await state.shared.registry_remove(target)
        log.info("admin: removed %s worker %s", target.role, target.url)
        return Response(orjson.dumps({"removed": target.info()}), media_type=_JSON)

    return app


class _RouterApp(FastAPI):
    """FastAPI, with POSTs on the hot paths dispatched straight to the raw ASGI handler."""

    hot_paths: frozenset = frozenset()
    hot = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.hot_paths:
            await self.hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _passthrough_error(e: UpstreamError) -> Response:
    """A worker rejected the request (4xx): give the client the worker's message, OpenAI-shaped."""
    msg, type_, param, code = None, "invalid_request_error", None, e.status
    if e.body:
        try:
            obj = orjson.loads(e.body)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
            m = err.get("message") or err.get("detail")
            msg = m if isinstance(m, str) else None
            type_ = err.get("type") if isinstance(err.get("type"), str) else type_
            param = err.get("param") if isinstance(err.get("param"), str) else None
            code = err.get("code", code)
        if not msg:
            msg = e.body[:500].decode("utf-8", "replace")
    return error_response(e.status, msg or e.message, type_, param=param, code=code)


# -- CLI ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="deployment YAML (see configs/router-example.yaml)")
    parser.add_argument("--host", help="bind address (default: router.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: router.port, 8000)")
    parser.add_argument("--policy", help="routing policy (default: router.policy, smetric)")
    parser.add_argument(
        "--replica-id", help="this replica's id in the shared state (default: router.replica_id)"
    )
    parser.add_argument("--model-path", help="local model dir with tokenizer.json (+ chat template)")
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[@BOOTSTRAP_PORT][#KV_EVENTS]",
        help="add a prefill worker (repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="add a decode worker (repeatable)"
    )
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")


def config_from_args(args) -> DeploymentConfig:
    cfg = load_config(args.config) if args.config else parse_config({})
    data = cfg.model_dump()
    if args.host:
        data["router"]["host"] = args.host
    if args.port is not None:
        data["router"]["port"] = args.port
    if args.policy:
        data["router"]["policy"] = args.policy
    if getattr(args, "replica_id", None):
        data["router"]["replica_id"] = args.replica_id
    if args.model_path:
        data["model"]["path"] = args.model_path
    if args.log_level:
        data["router"]["log_level"] = args.log_level
    for spec in args.prefill:
        kv = None
        if "#" in spec:
            spec, kv = spec.split("#", 1)
        bp = 8998
        if "@" in spec.split("://", 1)[-1]:
            spec, bps = spec.rsplit("@", 1)
            bp = int(bps)
        data["prefill"].append({"url": spec, "bootstrap_port": bp, "kv_events": kv})
    for url in args.decode:
        data["decode"].append({"url": url})
    return parse_config(data, source=args.config or "command line")


def run(args) -> int:
    import uvicorn

    cfg = config_from_args(args)
    if not cfg.prefill:
        raise ValueError("no prefill workers: list them under 'prefill:' in the config or pass --prefill URL")
    level = cfg.router.log_level.lower()
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every health check and load poll at INFO: only from debug level
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    app = create_app(cfg)
    print(
        f"smetric router: policy={cfg.router.policy} prefill={len(cfg.prefill)} decode={len(cfg.decode)} "
        f"on http://{cfg.router.host}:{cfg.router.port}",
        flush=True,
    )
    uvicorn.run(app, host=cfg.router.host, port=cfg.router.port, log_level=level, access_log=False)
    return 0
