"""The admin API: ``/admin/workers`` (list, add, drain and remove workers at run time),
``/admin/drain`` (this replica stops taking requests) and ``/admin/auth`` (the API keys' names and limits; ``POST /admin/auth/reload`` reads the keys
again, without a restart).

Every call needs ``Authorization: Bearer <token>``, the token read at start from the env
var named by ``router.admin_token_env``; with no token set the API answers 401 to all.
With router replicas a worker change is also written to the shared registry, so the other
replicas apply it; a key reload applies to the replica that gets it (each replica reads its
own keys file: reload each one).
"""

from __future__ import annotations

import logging
import secrets
import time
from urllib.parse import urlsplit

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from stack.pool import Worker
from stack.prefill_router.api.errors import JSON, error_response
from stack.prefill_router.api.gate import Gate
from stack.prefill_router.api.parse import read_json
from stack.prefill_router.auth import AuthConfigError
from stack.prefill_router.state import RouterState
from stack.prefill_router.worker_urls import BadWorkerUrl, check_host, networks, worker_url

log = logging.getLogger("stack.router")


def _authorized(state: RouterState, request: Request) -> bool:
    tok = state.admin_token
    if not tok:
        return False
    h = request.headers.get("authorization", "")
    if not h.lower().startswith("bearer "):
        return False
    return secrets.compare_digest(h[7:].strip().encode(), tok.encode())


def _unauthorized() -> Response:
    return error_response(
        401,
        "admin API needs 'Authorization: Bearer <token>' (token from the env var named by router.admin_token_env)",
        "authentication_error",
        code="unauthorized",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def _worker_spec(body: dict, allowed: list) -> tuple[str, str, int | None, str | None, str] | Response:
    """(role, url, bootstrap port, KV-events endpoint, KV topic) of a worker to add, or the
    422 answer naming the bad field (a URL: :mod:`stack.prefill_router.worker_urls`; its host
    and the KV-events endpoint's in ``allowed``, router.admin.worker_networks, when set)."""
    role = body.get("role", "prefill")
    if role not in ("prefill", "decode"):
        return error_response(422, "'role' must be prefill or decode", param="role", code="invalid_value")
    try:
        url = worker_url(body.get("url"))
        await check_host(urlsplit(url).hostname or "", allowed)
    except BadWorkerUrl as e:
        return error_response(422, str(e), param="url", code="invalid_value")
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
    if kv is not None and allowed:
        try:
            await check_host(urlsplit(kv).hostname or "", allowed)
        except (BadWorkerUrl, ValueError) as e:
            return error_response(422, str(e).replace("'url'", "'kv_events'"), param="kv_events")
    return role, url, bp, kv, str(body.get("kv_topic", "kv"))


def admin_router(state: RouterState, gate: Gate | None = None) -> APIRouter:
    """The admin routes over ``state``'s worker pool and ``gate``'s keys (None: no keys)."""
    router = APIRouter()
    max_body = state.cfg.router.max_body_bytes
    allowed = networks(state.cfg.router.admin.worker_networks)

    def _no_keys() -> Response:
        return error_response(
            404, "API keys are off: set router.auth.keys_file or keys_env", "not_found_error", code="no_keys"
        )

    @router.get("/admin/auth")
    async def auth_list(request: Request):
        """the API keys' names and limits (never a key); 404 `no_keys` when keys are off"""
        if not _authorized(state, request):
            return _unauthorized()
        if gate is None:
            return _no_keys()
        return Response(orjson.dumps(gate.describe()), media_type=JSON)

    @router.post("/admin/auth/reload")
    async def auth_reload(request: Request):
        """read the keys again, without a restart (this replica only: reload each replica); 422
        `invalid_keys` when they cannot be read, and the previous keys stay"""
        if not _authorized(state, request):
            return _unauthorized()
        if gate is None:
            return _no_keys()
        try:
            out = gate.reload()
        except AuthConfigError as e:  # the keys in use stay
            log.warning("admin: key reload refused: %s", e)
            return error_response(
                422, f"keys not reloaded (the previous ones stay): {e}", code="invalid_keys"
            )
        state.needs_features = state.policy.needs_prompt_features or gate.counts_tokens
        log.info("admin: reloaded %d API key(s)", len(out["keys"]))
        return Response(orjson.dumps(out), media_type=JSON)

    _drain_routes(router, state)

    @router.get("/admin/workers")
    async def admin_list(request: Request):
        """every worker of this replica's pool; a prefill worker also with its index blocks and
        where its index comes from (`events` or `routing-history`)"""
        if not _authorized(state, request):
            return _unauthorized()
        out = []
        for w in state.registry.workers.values():
            d = w.info()
            if w.role == "prefill":
                d["index_blocks"] = state.index.blocks(w.wid)
                d["kv_source"] = "events" if state.index.uses_events(w.wid) else "routing-history"
            out.append(d)
        return Response(orjson.dumps({"workers": out}), media_type=JSON)

    @router.post("/admin/workers")
    async def admin_add(request: Request):
        """add a worker at run time (201, the worker); with replicas, also to the shared
        registry, so that the others add it"""
        if not _authorized(state, request):
            return _unauthorized()
        got = await read_json(request, max_body)
        if isinstance(got, Response):
            return got
        spec = await _worker_spec(got[0], allowed)
        if isinstance(spec, Response):
            return spec
        try:
            w = state.registry.add(*spec)
        except ValueError as e:
            return error_response(409, str(e), code="conflict")
        if state.shared is not None:  # the other replicas pick it up
            await state.shared.registry.add(w)
        log.info("admin: added %s worker %s", w.role, w.url)
        return Response(orjson.dumps(w.info()), status_code=201, media_type=JSON)

    @router.delete("/admin/workers")
    async def admin_remove(request: Request):
        """remove a worker (with replicas, from the shared registry too); 404 when no worker
        matches"""
        if not _authorized(state, request):
            return _unauthorized()
        got = await read_json(request, max_body)
        if isinstance(got, Response):
            return got
        target = _find_worker(state, got[0])
        if target is None:
            return error_response(404, "no such worker", "not_found_error", code="not_found")
        state.registry.remove(target.wid)
        if state.shared is not None:
            await state.shared.registry.remove(target)
        log.info("admin: removed %s worker %s", target.role, target.url)
        return Response(orjson.dumps({"removed": target.info()}), media_type=JSON)

    return router


def _find_worker(state: RouterState, body: dict) -> Worker | None:
    """The worker a request body names: ``{"id": ...}`` or ``{"url": ..., "role": ...}``
    (role optional)."""
    url = body.get("url")
    role = body.get("role")
    wid = body.get("id")
    for w in state.registry.workers.values():
        if (wid is not None and w.wid == wid) or (
            url is not None and w.url == str(url).rstrip("/") and role in (None, w.role)
        ):
            return w
    return None


def _drain_routes(router: APIRouter, state: RouterState) -> None:
    """``/admin/drain`` (this replica: stack/prefill_router/drain.py) and
    ``/admin/workers/drain`` (a worker: stack/prefill_router/worker_drain.py)."""
    rc = state.cfg.router
    max_body = rc.max_body_bytes

    @router.post("/admin/drain")
    async def drain_start(request: Request):
        """This replica stops taking requests (stack/prefill_router/drain.py); what it holds
        runs to its end. The process keeps running: stop it once ``inflight`` is 0."""
        if not _authorized(state, request):
            return _unauthorized()
        state.drain.start()
        return Response(orjson.dumps(state.drain.describe()), media_type=JSON)

    @router.get("/admin/drain")
    async def drain_status(request: Request):
        """this replica's drain: whether it drains, and what it still holds"""
        if not _authorized(state, request):
            return _unauthorized()
        return Response(orjson.dumps(state.drain.describe()), media_type=JSON)

    @router.delete("/admin/drain")
    async def drain_stop(request: Request):
        """Take requests again (an admin drain undone)."""
        if not _authorized(state, request):
            return _unauthorized()
        state.drain.resume()
        log.warning("drain undone: taking requests again")
        return Response(orjson.dumps(state.drain.describe()), media_type=JSON)

    async def _drain_worker(request: Request, body: dict) -> Response:
        if not _authorized(state, request):
            return _unauthorized()
        w = _find_worker(state, body)
        if w is None:
            return error_response(404, "no such worker", "not_found_error", code="not_found")
        timeout = body.get("timeout_s")
        if timeout is None:
            timeout = rc.drain_timeout_s if rc.drain_timeout_s is not None else rc.request_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            return error_response(400, "timeout_s must be a number > 0", param="timeout_s")
        state.worker_drains.start(w, time.time() + float(timeout))
        if state.shared is not None:  # the other replicas stop routing to it too
            await state.shared.registry.add(w)
        return Response(orjson.dumps({"draining": w.info()}), status_code=202, media_type=JSON)

    @router.post("/admin/workers/drain")
    async def worker_drain(request: Request):
        """Drain the worker the body names (``id``, or ``url`` and ``role``), within
        ``timeout_s`` (default ``router.drain_timeout_s``, else the request timeout)."""
        got = await read_json(request, max_body)
        if isinstance(got, Response):
            return got
        return await _drain_worker(request, got[0] if isinstance(got[0], dict) else {})

    @router.post("/admin/workers/{wid}/drain")
    async def worker_drain_by_id(wid: int, request: Request):
        """Drain worker ``wid`` (this replica's id, as ``GET /admin/workers`` lists it;
        ``?timeout_s=`` as the body's)."""
        q = request.query_params.get("timeout_s")
        try:
            timeout = float(q) if q is not None else None
        except ValueError:
            return error_response(400, "timeout_s must be a number > 0", param="timeout_s")
        return await _drain_worker(request, {"id": wid, "timeout_s": timeout})
