"""docs/reference/http-api.md: the router's routes, their auth, and its error shapes.

The routes are the app's own table: :func:`~stack.prefill_router.api.app.create_app` builds the
app (never served; its lifespan never runs) and FastAPI's ``app.openapi()`` lists every route
with its endpoint's docstring (the router serves no OpenAPI schema: ``openapi_url`` is None).
Which route needs which key follows :mod:`stack.prefill_router.api.gate`'s constants; the
inference endpoints' properties are :data:`~stack.prefill_router.api.endpoints.ENDPOINTS`; the
error bodies are the envelopes' real answers (:mod:`stack.prefill_router.api.errors`), and the
unknown-path and wrong-method answers come from the app itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import Response

from stack.config import parse_config
from stack.prefill_router.api.endpoints import ENDPOINTS
from stack.prefill_router.api.errors import ANTHROPIC, OPENAI, RESPONSES, Envelope
from stack.prefill_router.api.gate import LIMITED_PATHS, OPEN_PATHS
from stack.reference.http_notes import REQUESTS, SUMMARIES
from stack.reference.markdown import HEADER, code, table, text

#: the envelopes by the name the page gives their API
ENVELOPES: dict[str, Envelope] = {"OpenAI": OPENAI, "Anthropic": ANTHROPIC, "OpenAI Responses": RESPONSES}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    auth: str
    request: str


def build_app() -> FastAPI:
    """The router app of a default config (every route is there whatever the config)."""
    from stack.prefill_router.api.app import create_app

    return create_app(parse_config({}))


def auth_of(path: str) -> str:
    """What a request to ``path`` must carry (gate.py: ``/admin/`` has its own token; the open paths;
    the limited client paths; the inference endpoints)."""
    if path.startswith("/admin/"):
        return "admin token"
    if path in OPEN_PATHS:
        return "none"
    if path == "/metrics":
        return "API key if `router.auth.protect_metrics`"
    if path in ENDPOINTS:
        return "API key; all its limits"
    if path in LIMITED_PATHS:
        return "API key; its request and concurrency limits"
    return "API key"


def routes(app: FastAPI | None = None) -> list[Route]:
    """Every route of the app, in its order, with what it does (the endpoint's docstring, else
    :data:`~stack.reference.http_notes.SUMMARIES`). Raises ``LookupError`` for a route with neither."""
    schema = (app or build_app()).openapi()
    out: list[Route] = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            key = (method.upper(), path)
            summary = text(op.get("description")) or SUMMARIES.get(key)
            if not summary:
                raise LookupError(
                    f"{key[0]} {path}: no docstring and no note: give its endpoint a docstring "
                    "(or stack/reference/http_notes.py a summary)"
                )
            out.append(Route(key[0], path, summary, auth_of(path), REQUESTS.get(key, "")))
    return out


def stale_notes(app: FastAPI | None = None) -> list[str]:
    """Summaries and requests naming a route the app does not have, and summaries of a route whose
    endpoint now has a docstring (the docstring wins: delete the note)."""
    schema = (app or build_app()).openapi()
    have = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    documented = {
        (m.upper(), p) for p, ops in schema["paths"].items() for m, op in ops.items() if op.get("description")
    }
    gone = (set(SUMMARIES) | set(REQUESTS)) - have
    return sorted(f"{m} {p}" for m, p in gone | (set(SUMMARIES) & documented))


def _answer(resp: Response) -> tuple[str, str, str]:
    body = json.loads(bytes(resp.body))
    retry = resp.headers.get("retry-after")
    auth = resp.headers.get("www-authenticate")
    headers = ", ".join(
        h
        for h in (f"Retry-After: {retry}" if retry else "", f"WWW-Authenticate: {auth}" if auth else "")
        if h
    )
    return str(resp.status_code), headers, code(json.dumps(body, sort_keys=True))


#: (case, how the envelope answers it), with placeholder messages
_CASES: tuple[tuple[str, Callable[[Envelope], Response]], ...] = (
    (
        "a client's mistake (e.g. a bad field)",
        lambda e: e.client(400, "<message>", param="<field>", code="<code>"),
    ),
    ("a model the router does not serve (`router.models`)", lambda e: e.model_not_found("<model>")),
    (
        "no key, a malformed or unknown key (`router.auth`)",
        lambda e: e.unauthorized("<message>", "invalid_api_key"),
    ),
    ("a key over a request or concurrency limit", lambda e: e.rate_limited("<message>", "requests", 1)),
    ("a key over its prompt-token limit", lambda e: e.rate_limited("<message>", "prompt_tokens", 1)),
    ("a key header over `router.auth.max_key_bytes`", lambda e: e.header_too_large("<message>")),
    ("no healthy worker for a role", lambda e: e.no_worker("prefill", 1)),
    ("the dispatch queue refuses it, or the replica drains", lambda e: e.overloaded("<message>", 1)),
    ("workers failed on both tries", lambda e: e.bad_gateway("<message>")),
    ("the router's own failure (logged, never sent)", lambda e: e.internal()),
)


def _errors() -> list[str]:
    out = [
        "## Errors\n",
        "Every error is answered in the shape of the client's API: OpenAI's "
        '`{"error": {"message", "type", "param", "code"}}` for every endpoint but the Anthropic ones '
        '(`/v1/messages...`), which answer `{"type": "error", "error": {"type", "message"}}`. A worker\'s '
        "own 4xx is passed on in the same shape, with the worker's message. These are the router's answers, "
        "with `Retry-After` at `router.retry_after_s` (1 here); the messages are placeholders.\n",
    ]
    for name, env in ENVELOPES.items():
        apis = sorted(p for p, e in ENDPOINTS.items() if e.envelope is env)
        out.append(f"### {name}\n")
        out.append(
            "Endpoints: "
            + ", ".join(code(p) for p in apis)
            + ("; and every other path" if env is OPENAI else "")
            + ".\n"
        )
        rows = []
        for case, make in _CASES:
            status, headers, body = _answer(make(env))
            rows.append((case, status, headers, body))
        if env.sse_error is not None:
            frame = env.sse_error("<message>").decode().strip().replace("\n", " ")
            rows.append(("a stream that fails mid-way (its last frame)", "200", "", code(frame)))
        out.append(table(("Case", "Status", "Headers", "Body"), rows))
    out.append(_app_errors())
    return out


def _app_errors() -> str:
    """The app's own answers to an unknown path and a wrong method."""
    from fastapi.testclient import TestClient

    client = TestClient(build_app())  # no `with`: the lifespan (workers, health checks) never starts
    rows = []
    for case, method, path in (
        ("an unknown path", "GET", "/v1/nope"),
        ("a method the path does not take", "PUT", "/health"),
        ("an unknown Anthropic path", "GET", "/v1/messages/nope"),
    ):
        r = client.request(method, path)
        rows.append(
            (f"{case} (`{method} {path}`)", str(r.status_code), code(json.dumps(r.json(), sort_keys=True)))
        )
    return "### Unknown paths and methods\n\n" + table(("Case", "Status", "Body"), rows)


def _inference() -> str:
    rows = []
    for path, e in ENDPOINTS.items():
        env = next(n for n, v in ENVELOPES.items() if v is e.envelope)
        rows.append(
            (
                code(path),
                code(e.name),
                env,
                "answered by the router"
                if e.local is not None
                else ("prefill and decode" if e.decode else "prefill only"),
                "none"
                if e.local is not None
                else {"body": "body `priority`", "header": "`x-override-priority` header", None: "none"}[
                    e.priority
                ],
                "yes" if e.checks_model else "no",
            )
        )
    return (
        "## Inference endpoints\n\n"
        "How each inference endpoint is served (`stack/prefill_router/api/endpoints.py`). *Name*: its "
        "`endpoint` label in `smetric_requests_total`. *Workers*: under PD, whether a decode worker takes "
        "part (a colocated pool has one worker per request). *Priority*: how an SGLang priority travels with "
        "`router.dispatch.sglang_priority`. *Model checked*: a `model` the router does not serve is a 404.\n\n"
        + table(("Path", "Name", "Errors", "Workers", "Priority", "Model checked"), rows)
    )


def render(app: FastAPI | None = None) -> str:
    """The page."""
    rs = routes(app)
    out: list[str] = [
        HEADER,
        "# HTTP API reference\n",
        "Every route of the router (`smetric router`), in the order the app registers them. *Auth*: "
        "`admin token`: `Authorization: Bearer <token>` with the token of the env var named by "
        "`router.admin_token_env` (none set: 401 to every admin call); `API key`: only with client keys "
        "on (`router.auth.keys_file` or `keys_env`), sent as `Authorization: Bearer <key>` or "
        "`x-api-key: <key>`, with the key's limits as the route says; `none`: always open.\n",
        table(
            ("Method", "Path", "Auth", "What it does"),
            ((r.method, code(r.path), r.auth, r.summary) for r in rs),
        ),
        "## Requests\n",
        "What each route reads (the router parses bodies itself; a body over `router.max_body_bytes` is a 413, "
        "one that is not JSON a 400). Routes not listed read no body.\n",
        table(("Method", "Path", "Request"), ((r.method, code(r.path), r.request) for r in rs if r.request)),
        _inference(),
        *_errors(),
    ]
    return "\n".join(out)
