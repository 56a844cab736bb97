"""The emulated worker's API keys, as SGLang 0.5.23 checks them (``--api-key``,
``--admin-api-key``; sglang/srt/utils/auth.py).

- ``/health*``, ``/ready*`` and ``/metrics*`` are always open (probes and scrapers);
- the admin endpoints (here ``/abort_request``, ``/flush_cache``; SGLang's ``ADMIN_OPTIONAL``):
  with an admin key only that key, else with an API key only that key, else open;
- every other endpoint: with an API key only that key (the admin key is not accepted there),
  else open;
- the PD bootstrap endpoints (``/kv/register``, ``/route``) stay open: SGLang serves them on
  its bootstrap server, which checks no key.

A key is ``Authorization: Bearer <key>``, compared in constant time. A refusal is SGLang's:
401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import secrets

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

#: SGLang's open prefixes
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
#: the emulator's endpoints SGLang marks ADMIN_OPTIONAL
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache"})
#: served by SGLang's bootstrap server (no key) rather than its HTTP server
BOOTSTRAP_PATHS = frozenset({"/kv/register", "/route"})


def allowed(path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang's decision for a request on ``path`` with the ``Authorization`` header given."""
    if path.startswith(OPEN_PREFIXES) or path in BOOTSTRAP_PATHS:
        return True
    need = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
    if not need:
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.encode(), need.encode())


class ApiKeyCheck:
    """ASGI middleware refusing what :func:`allowed` refuses (installed only with a key set)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            authz = None
            for k, v in scope["headers"]:
                if k == b"authorization":
                    authz = v.decode("latin-1")
                    break
            if not allowed(scope["path"], authz, self.api_key, self.admin_api_key):
                body = orjson.dumps({"error": "Unauthorized"})
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
