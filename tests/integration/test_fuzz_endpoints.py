"""Hostile input against the router's public endpoints: no 5xx, no crash, no hang; the admin API
rejects a missing or wrong token; the router binds loopback unless told otherwise; its logs
never carry request bodies or credentials.

(tests/integration/test_router_robustness.py fuzzes message-shaped chat bodies and raw bytes on the chat
path; this file adds arbitrary JSON and wrong-typed fields on every endpoint, raw bytes with
broken UTF-8 everywhere, numbers past 64 bits, deep nesting, random paths and methods, and the
admin API.) Hypothesis examples are bounded so the file runs in well under a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from argparse import Namespace

import anthropic
import httpx
import openai
import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack.models.tiny import build_tiny_model
from stack.ports import free_port
from stack.worker.fake import FakeWorker, ServerThread
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)

TOKEN = "fuzz-admin-token-0123456789"
GEN_PATHS = ["/v1/chat/completions", "/v1/completions", "/generate"]
ADMIN_PATHS = ["/admin/workers"]
GET_PATHS = ["/v1/models", "/health", "/metrics"]
FAST = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    os.environ["SMETRIC_FUZZ_ADMIN_TOKEN"] = TOKEN
    c = Cluster(
        model_dir,
        n_prefill=2,
        n_decode=1,
        admin_env="SMETRIC_FUZZ_ADMIN_TOKEN",
        router={
            "max_body_bytes": 1 << 20,
            "eject_cooldown_s": 0.0,
            "admin": {"worker_networks": ["127.0.0.0/8", "::1/128"]},
        },
    )
    c.client.timeout = httpx.Timeout(30.0)  # a hang fails the test
    yield c
    c.close()
    os.environ.pop("SMETRIC_FUZZ_ADMIN_TOKEN", None)


def _well_formed_error(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


def _alive(c: Cluster) -> None:
    assert c.client.get("/health").status_code == 200


# -- strategies ----------------------------------------------------------------------------------
big_ints = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([2**63, 2**64, -(2**63) - 1])
scalars = (
    st.none()
    | st.booleans()
    | big_ints
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["", "\x00", "\u202e", "\ud7ff\ue000", "😀" * 50, "a" * 3000])
)
any_json = st.recursive(
    scalars,
    lambda ch: st.lists(ch, max_size=5) | st.dictionaries(st.text(max_size=12), ch, max_size=5),
    max_leaves=20,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "text",
    "input_ids",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "stop",
    "tools",
    "tool_choice",
    "sampling_params",
    "chat_template_kwargs",
    "rid",
    "session_id",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "logprobs",
    "response_format",
]
valid_chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
valid_prompt = {"prompt": "hello there", "text": "hello there", "max_tokens": 3}


@st.composite
def wrong_typed(draw):
    """A valid body with one to three fields replaced by arbitrary JSON."""
    base = dict(draw(st.sampled_from([valid_chat, valid_prompt])))
    for key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        base[key] = draw(any_json)
    return base


def _dumps(obj) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # ints past 64 bits: write them by hand, the router must still cope
        return repr(obj).replace("None", "null").replace("True", "true").replace("False", "false").encode()


# -- the generation endpoints -------------------------------------------------------------------
@FAST
@given(path=st.sampled_from(GEN_PATHS), body=any_json)
def test_arbitrary_json_never_5xx(cluster, path, body):
    _well_formed_error(cluster.client.post(path, content=_dumps(body)))


@FAST
@given(path=st.sampled_from(GEN_PATHS), body=wrong_typed())
def test_wrong_typed_fields_never_5xx(cluster, path, body):
    r = cluster.client.post(path, content=_dumps(body))
    _well_formed_error(r)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(GEN_PATHS + ADMIN_PATHS), raw=st.binary(max_size=200), prefix=st.booleans())
def test_invalid_bytes_never_5xx(cluster, path, raw, prefix):
    # raw bytes, or bytes (broken UTF-8 included) inside an otherwise plausible JSON string
    data = (
        (b'{"messages": [{"role": "user", "content": "' + raw + b'"}], "prompt": "' + raw + b'"}')
        if prefix
        else raw
    )
    r = cluster.client.post(path, content=data, headers={"Authorization": f"Bearer {TOKEN}"})
    _well_formed_error(r)


def test_pathological_bodies(cluster):
    post = cluster.client.post
    cases = [
        b"[" * 100_000,  # nesting far past any parser's recursion limit
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"max_tokens": 1' + b"0" * 400 + b', "prompt": "x"}',  # a 400-digit integer
        b'{"prompt": "x", "temperature": 1e400}',
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "\\ud800"}',  # a lone surrogate escape
        b'{"prompt": "x", "prompt": 3}',  # duplicate keys
        b"\xef\xbb\xbf" + orjson.dumps(valid_prompt),  # BOM
        orjson.dumps({"prompt": list(range(100_000))}),  # over the context length
        orjson.dumps({"input_ids": [[1, 2], [3]], "sampling_params": {}}),
        orjson.dumps({"input_ids": [-1, 2**40], "sampling_params": {}}),
        orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}] * 50}]}),
        b" " * 1000,
        b"null",
    ]
    for path in GEN_PATHS:
        for data in cases:
            _well_formed_error(post(path, content=data))
    # over the body limit, with and without a Content-Length
    r = post("/v1/chat/completions", content=b'{"prompt": "' + b"x" * (1 << 20) + b'"}')
    assert r.status_code == 413
    r = post("/v1/completions", content=iter([b'{"prompt": "', b"x" * (1 << 20), b'"}']))
    assert r.status_code == 413
    # framing httpx will not send: a bad Content-Length, a body shorter than announced
    for raw in (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{}",
        b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    ):
        status = _raw_exchange(cluster.router.port, raw)
        assert status is None or status < 500, (raw, status)
    _alive(cluster)


def _raw_exchange(port: int, data: bytes) -> int | None:
    """Send raw bytes, half-close, return the answer's status (None: closed without one)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n" not in buf:
            got = s.recv(4096)
            if not got:
                break
            buf += got
    if not buf.startswith(b"HTTP/1.1 "):
        return None
    return int(buf.split(b" ", 2)[1])


@FAST
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=st.sampled_from(
        GEN_PATHS + GET_PATHS + ADMIN_PATHS + ["/", "/v1", "/admin", "/docs", "/openapi.json"]
    )
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._-%~", min_size=1, max_size=40).map(
        lambda s: "/" + s
    ),
    query=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789=&%+", max_size=30),
)
def test_any_method_and_path_never_5xx(cluster, method, path, query):
    r = cluster.client.request(method, path + ("?" + query if query else ""), content=b"{}")
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300])
    if r.status_code >= 400 and method != "HEAD":
        assert "error" in r.json()


def test_router_alive_after_fuzzing(cluster):
    _alive(cluster)
    r = cluster.client.post("/v1/chat/completions", json=valid_chat)
    assert r.status_code == 200


# -- admin: a missing or wrong token is always refused ------------------------------------------------
@FAST
@given(
    auth=st.none()
    | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60).map(str.strip)
    | st.sampled_from(
        [
            "",
            "Bearer",
            f"Basic {TOKEN}",
            f"Token {TOKEN}",
            f"Bearer {TOKEN[:-1]}",
            f"Bearer {TOKEN}x",
            f"Bearer x{TOKEN}",
            f"Bearer {TOKEN.upper()}",
            f"{TOKEN}",
            f"Bearer {TOKEN} {TOKEN}",
        ]
    ),
    method=st.sampled_from(["GET", "POST", "DELETE"]),
)
def test_admin_rejects_missing_or_wrong_token(cluster, auth, method):
    headers = {} if auth is None else {"Authorization": auth}
    body = orjson.dumps({"role": "prefill", "url": "http://127.0.0.1:9"})
    r = cluster.client.request(method, "/admin/workers", content=body, headers=headers)
    assert r.status_code == 401, (auth, r.status_code)
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers.get("www-authenticate") == "Bearer"


def test_admin_token_in_query_or_other_header_is_refused(cluster):
    for kw in (
        {"params": {"token": TOKEN}},
        {"params": {"access_token": TOKEN}},
        {"headers": {"X-Api-Key": TOKEN}},
        {"headers": {"Cookie": f"token={TOKEN}"}},
    ):
        assert cluster.client.get("/admin/workers", **kw).status_code == 401
    ok = cluster.client.get("/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and len(ok.json()["workers"]) == 3
    # the scheme is case-insensitive (RFC 7235), the token is not
    assert (
        cluster.client.get("/admin/workers", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["POST", "DELETE"]), body=any_json | wrong_typed())
def test_admin_with_token_fuzzed_bodies_never_5xx(cluster, method, body):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    if method == "POST" and isinstance(body, dict):
        body = dict(body, url="http://127.0.0.1:1") if "url" in body else body
    r = cluster.client.request(method, "/admin/workers", content=_dumps(body), headers=auth)
    _well_formed_error(r)
    # never leave a fuzzed worker behind: only the cluster's three stay
    for w in cluster.client.get("/admin/workers", headers=auth).json()["workers"]:
        if w["url"] not in [s.url for s in cluster.servers]:
            cluster.client.request("DELETE", "/admin/workers", json={"id": w["id"]}, headers=auth)


# -- fields as the APIs define them, each as the official SDK raises it (issue 41) ---------------------
MSG = [{"role": "user", "content": "hello there"}]
FN = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def oa(cluster):
    c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def an(cluster):
    c = anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def _chat(oa, **kw):
    return oa.chat.completions.create(**{"model": "tiny", "messages": MSG, "max_tokens": 2, **kw})


#: (case, call, the field named); every one a 400 that the OpenAI SDK raises as BadRequestError
OPENAI_BAD = [
    ("n above 1", lambda oa, url: _chat(oa, n=3), "n"),
    ("n 0", lambda oa, url: _chat(oa, n=0), "n"),
    (
        "a bogus role",
        lambda oa, url: _chat(oa, messages=[{"role": "bogus", "content": "x"}]),
        "messages[0].role",
    ),
    ("tools not objects", lambda oa, url: _chat(oa, tools=[1, 2]), "tools[0]"),
    (
        "a tool named 123",
        lambda oa, url: _chat(oa, tools=[{"type": "function", "function": {"name": 123}}]),
        "tools[0].function.name",
    ),
    (
        "a tool whose parameters is a string",
        lambda oa, url: _chat(oa, tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        "tools[0].function.parameters",
    ),
    (
        "a tool_choice naming a missing function",
        lambda oa, url: _chat(oa, tools=[FN], tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    ("tool_choice required without tools", lambda oa, url: _chat(oa, tool_choice="required"), "tool_choice"),
    ("a negative max_tokens", lambda oa, url: _chat(oa, max_tokens=-1), "max_tokens"),
    ("no messages (was 422)", lambda oa, url: _chat(oa, messages=[]), "messages"),
    (
        "a stream flag that is no boolean (was 422)",
        lambda oa, url: _chat(oa, extra_body={"stream": "yes"}),
        "stream",
    ),
    (
        "completions: n above 1",
        lambda oa, url: oa.completions.create(model="tiny", prompt="hi", n=3, max_tokens=2),
        "n",
    ),
    (
        "completions: a negative max_tokens",
        lambda oa, url: oa.completions.create(model="tiny", prompt="hi", max_tokens=-1),
        "max_tokens",
    ),
    (
        "/generate: a negative max_new_tokens",
        lambda oa, url: oa.post(
            url + "/generate", body={"text": "hi", "sampling_params": {"max_new_tokens": -1}}, cast_to=object
        ),
        "sampling_params.max_new_tokens",
    ),
    (
        "/generate: n above 1",
        lambda oa, url: oa.post(
            url + "/generate", body={"text": "hi", "sampling_params": {"n": 2}}, cast_to=object
        ),
        "sampling_params.n",
    ),
    (
        "responses: a tool_choice naming a missing function",
        lambda oa, url: oa.responses.create(
            model="tiny",
            input="hi",
            tools=[{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}],
            tool_choice={"type": "function", "name": "nope"},
        ),
        "tool_choice",
    ),
]


@pytest.mark.parametrize("case,call,param", OPENAI_BAD, ids=[c[0] for c in OPENAI_BAD])
def test_a_bad_field_is_400_naming_it(cluster, oa, case, call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call(oa, cluster.url)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert e.value.type == "invalid_request_error"


#: unknown model names: a 404 the OpenAI SDK raises as NotFoundError, on every endpoint that has one
OPENAI_UNKNOWN_MODEL = [
    ("chat", lambda oa: _chat(oa, model="gpt-4o")),
    ("completions", lambda oa: oa.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)),
    ("embeddings", lambda oa: oa.embeddings.create(model="text-embedding-3-small", input="hi")),
    ("responses", lambda oa: oa.responses.create(model="gpt-4o", input="hi")),
    ("lora of an unknown base", lambda oa: _chat(oa, model="other:adapter")),
]


@pytest.mark.parametrize("case,call", OPENAI_UNKNOWN_MODEL, ids=[c[0] for c in OPENAI_UNKNOWN_MODEL])
def test_an_unknown_model_is_404(oa, case, call):
    with pytest.raises(openai.NotFoundError) as e:
        call(oa)
    assert e.value.code == "model_not_found" and e.value.param == "model"


@pytest.mark.parametrize("model", ["tiny", "tiny:my-adapter", "claude-sonnet-4-5", ""])
def test_the_served_model_its_lora_adapters_and_claude_names_are_served(cluster, oa, model):
    # "": no model named (SGLang serves its own); "tiny:my-adapter": SGLang's base:adapter
    assert cluster.client.post("/v1/chat/completions", json={**CHAT_BODY, "model": model}).status_code == 200
    assert [m.id for m in oa.models.list().data] == ["tiny"]


CHAT_BODY = {"messages": MSG, "max_tokens": 2}

#: Messages: (case, body fields over a valid request, the SDK's exception)
ANTHROPIC_BAD = [
    ("an unknown model", {"model": "gpt-4o"}, anthropic.NotFoundError),
    ("a negative max_tokens", {"max_tokens": -1}, anthropic.BadRequestError),
    ("a bogus role", {"messages": [{"role": "bogus", "content": "x"}]}, anthropic.BadRequestError),
    (
        "a tool_choice naming a missing tool",
        {
            "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        anthropic.BadRequestError,
    ),
    ("tools not objects", {"tools": [1, 2]}, anthropic.BadRequestError),
]


@pytest.mark.parametrize("case,fields,exc", ANTHROPIC_BAD, ids=[c[0] for c in ANTHROPIC_BAD])
def test_messages_refusals_are_what_the_anthropic_sdk_raises(an, case, fields, exc):
    kw = {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": MSG, **fields}
    with pytest.raises(exc) as e:
        an.messages.create(**kw)
    err = e.value.body["error"]
    assert e.value.body["type"] == "error" and err["type"] in ("invalid_request_error", "not_found_error")
    if exc is anthropic.NotFoundError:  # the router's answer, not a worker's
        assert "'gpt-4o' does not exist" in err["message"], err


# -- admin URLs: http(s), host and port only, inside router.admin.worker_networks ------------------------
BAD_WORKER_URLS = [
    ("http://", "no host"),
    ("http://user:pass@127.0.0.1:9", "user or password"),
    ("http://127.0.0.1:9/v1", "no path"),
    ("http://127.0.0.1:9?x=1", "no query"),
    ("http://127.0.0.1:9#frag", "no fragment"),
    ("ftp://127.0.0.1:9", "scheme"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://a b:9", "whitespace"),
    ("http://10.1.2.3:9", "outside router.admin.worker_networks"),
    ("http://[fe80::1]:9", "outside router.admin.worker_networks"),
    (42, "http(s) URL"),
]


@pytest.mark.parametrize("url,problem", BAD_WORKER_URLS, ids=[str(u) for u, _ in BAD_WORKER_URLS])
def test_admin_refuses_a_worker_url_that_is_not_host_and_port(cluster, url, problem):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = cluster.client.post("/admin/workers", json={"role": "decode", "url": url}, headers=auth)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "url" and problem in err["message"], err
    assert len(cluster.client.get("/admin/workers", headers=auth).json()["workers"]) == 3


def test_admin_takes_a_worker_inside_its_networks(cluster):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for url, stored in (
        ("http://127.0.0.1:9/", "http://127.0.0.1:9"),
        ("http://localhost:9", "http://localhost:9"),
    ):
        r = cluster.client.post("/admin/workers", json={"role": "decode", "url": url}, headers=auth)
        assert r.status_code == 201 and r.json()["url"] == stored, r.text
        cluster.client.request("DELETE", "/admin/workers", json={"id": r.json()["id"]}, headers=auth)


# -- loopback by default ------------------------------------------------------------------------------
def test_loopback_is_the_default_everywhere():
    from stack.config import RouterConfig, parse_config
    from stack.launch import emulated
    from stack.prefill_router.service import config_from_args
    from stack.worker.settings import WorkerSettings

    assert RouterConfig().host == "127.0.0.1"
    assert parse_config({}).router.host == "127.0.0.1"
    args = Namespace(
        config=None, host=None, port=None, policy=None, model_path=None, prefill=[], decode=[], log_level=None
    )
    assert config_from_args(args).router.host == "127.0.0.1"
    assert WorkerSettings().host == "127.0.0.1"
    assert emulated.plan({"launch": {"mooncake_master": None}})["host"] == "127.0.0.1"
    args.host = "0.0.0.0"  # only when told
    assert config_from_args(args).router.host == "0.0.0.0"


def _listening_addrs(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, p = f[1].rsplit(":", 1)
            if int(p, 16) == port and f[3] == "0A":  # LISTEN
                out.add(addr)
    return out


# -- logs: no bodies, no keys -------------------------------------------------------------------------
SECRET_BODY = "ZEBRA-BODY-b7e1c2d9"
API_KEY = "sk-secret-APIKEY-5f0e9a1c"
ADMIN_TOKEN = "adm-secret-TOKEN-77d2"


def test_router_process_binds_loopback_and_never_logs_bodies_or_keys(tmp_path, model_dir):
    p0 = ServerThread(FakeWorker(mode="prefill", name="p0", fail="500")).start()  # a retry path
    p1 = ServerThread(FakeWorker(mode="prefill", name="p1")).start()
    dw = FakeWorker(mode="decode", name="d", tokens=3)
    d = ServerThread(dw).start()
    port = free_port()
    cfg = {
        "model": {"name": "tiny", "path": str(model_dir), "page_size": 16, "context_length": 4096},
        "router": {"port": port, "log_level": "debug", "admin_token_env": "SMETRIC_LOGTEST_TOKEN"},
        "prefill": [{"url": p0.url, "bootstrap_port": 9001}, {"url": p1.url, "bootstrap_port": 9002}],
        "decode": [{"url": d.url}],
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))  # no host: the default
    env = dict(os.environ, PYTHONUNBUFFERED="1", SMETRIC_LOGTEST_TOKEN=ADMIN_TOKEN)
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "router", "--config", str(tmp_path / "r.yaml")],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 30, "router did not come up"
            time.sleep(0.1)
        assert _listening_addrs(port) == {"0100007F"}  # 127.0.0.1, nothing else
        key = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, timeout=30) as c:
            msgs = [{"role": "user", "content": f"please keep {SECRET_BODY} private " * 5}]
            assert c.post("/v1/chat/completions", json={"messages": msgs}, headers=key).status_code == 200
            with c.stream(
                "POST", "/v1/chat/completions", json={"messages": msgs, "stream": True}, headers=key
            ) as s:
                assert b"[DONE]" in b"".join(s.iter_raw())
            assert c.post("/generate", json={"text": SECRET_BODY * 3}, headers=key).status_code == 200
            # errors of every kind, each carrying the secret somewhere
            c.post("/v1/chat/completions", content=f'{{"messages": "{SECRET_BODY}'.encode(), headers=key)
            c.post(
                "/v1/chat/completions", json={"messages": [{"role": 3, "content": SECRET_BODY}]}, headers=key
            )
            c.post("/v1/completions", json={"prompt": SECRET_BODY, "max_tokens": SECRET_BODY}, headers=key)
            c.get("/admin/workers", headers={"Authorization": f"Bearer {API_KEY}"})
            c.get("/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            c.post(
                "/admin/workers",
                json={"role": "prefill", "url": "http://127.0.0.1:1", "kv_topic": SECRET_BODY},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
            dw.fail = "400"  # a worker rejecting the request: its message goes to the client only
            c.post("/v1/chat/completions", json={"messages": msgs}, headers=key)
            dw.fail = "500"
            c.post("/v1/chat/completions", json={"messages": msgs}, headers=key)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        for s in (p0, p1, d):
            s.stop()
    text = log_path.read_text(errors="replace")
    assert "DEBUG" in text or "WARNING" in text  # logging was on (debug level)
    assert "retrying" in text  # the failing prefill worker was logged
    for secret in (SECRET_BODY, SECRET_BODY.lower(), API_KEY, ADMIN_TOKEN, "sk-secret"):
        assert secret not in text, f"{secret!r} in the router's log"
