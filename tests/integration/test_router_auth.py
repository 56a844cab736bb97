"""API keys and per-key limits on the router (``router.auth``): 401 for a missing, malformed or
unknown key and 429 with Retry-After over a limit, each in the endpoint's API shape (OpenAI's
error object, Anthropic's envelope); 431 for a huge key header; both ``x-api-key`` and
``Authorization: Bearer``; ``/health`` and ``/metrics`` open; metrics by key name, never the key;
reload through the admin API; a key file that cannot be read stops ``smetric router``; the
workers' key sent to workers, never the client's."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from stack.models.tiny import build_tiny_model
from stack.prefill_router.auth import AuthConfigError, load_keys, parse_keys
from stack.prefill_router.limits import Limits, LocalLimiter
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(90)

ADMIN_ENV = "SMETRIC_TEST_AUTH_ADMIN"
ADMIN = "admin-token-for-tests"
KEY_A = "sk-team-a-0123456789"
KEY_RATE = "sk-rate-0123456789"
KEY_TOK = "sk-tokens-0123456789"
KEY_CONC = "sk-conc-0123456789"

OPENAI_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/generate"]
ANTHROPIC_PATHS = ["/v1/messages", "/v1/messages/count_tokens"]


def _sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def _keys_doc() -> dict:
    return {
        "keys": [
            {"name": "team-a", "key": KEY_A},
            {"name": "rate", "sha256": _sha(KEY_RATE), "requests_per_s": 0.2, "request_burst": 2},
            {"name": "tokens", "key": KEY_TOK, "prompt_tokens_per_s": 1, "prompt_token_burst": 50},
            {"name": "conc", "key": KEY_CONC, "max_concurrency": 1},
        ]
    }


def _body(path: str, words: int = 3) -> dict:
    text = "please answer " * words
    if path in ("/v1/completions",):
        return {"model": "tiny", "max_tokens": 4, "prompt": text}
    if path == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": 4}}
    if path == "/v1/embeddings":
        return {"model": "tiny", "input": text}
    if path == "/v1/responses":
        return {"model": "tiny", "max_output_tokens": 4, "input": text}
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(yaml.safe_dump(_keys_doc()))
    kw = {"agent_paths": True}
    c = Cluster(
        model_dir,
        router={"auth": {"keys_file": str(keys)}},
        prefill_kw=kw,
        decode_kw=kw,
        admin_env=ADMIN_ENV,
    )
    yield c
    c.close()


def _openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _anthropic_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and body["error"]["message"]
    return body["error"]


# -- the keys document --------------------------------------------------------------------------
def test_keys_are_kept_hashed_and_checked_whole(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text(yaml.safe_dump({"defaults": {"requests_per_s": 5}, **_keys_doc()}))
    from stack.config import AuthConfig

    store = load_keys(AuthConfig(keys_file=str(p)))
    assert store.names == ["conc", "rate", "team-a", "tokens"]
    assert store.find(KEY_A.encode()).name == "team-a"
    assert store.find(KEY_RATE.encode()).name == "rate"
    assert store.find(b"sk-nope-0123456789") is None
    # only digests are kept: no key's text is anywhere in the store
    assert all(len(k.digest) == 32 for k in store.by_digest.values())
    assert KEY_A.encode() not in repr(store.by_digest).encode() and KEY_A not in repr(vars(store))
    # defaults apply where a key sets none of its own
    assert store.find(KEY_A.encode()).limits.requests_per_s == 5
    assert store.find(KEY_RATE.encode()).limits.requests_per_s == 0.2
    for bad, why in [
        ({"keys": []}, "no keys"),
        ({"keys": [{"name": "a", "key": "short"}]}, "at least 8"),
        ({"keys": [{"name": "a", "key": KEY_A, "sha256": _sha(KEY_A)}]}, "exactly one"),
        ({"keys": [{"name": "a", "sha256": "xyz"}]}, "64 hex"),
        ({"keys": [{"name": "a", "key": KEY_A}, {"name": "a", "key": KEY_RATE}]}, "used twice"),
        ({"keys": [{"name": "a", "key": KEY_A}, {"name": "b", "sha256": _sha(KEY_A)}]}, "same key"),
        ({"keys": [{"name": "a b", "key": KEY_A}]}, "'name'"),
        ({"keys": [{"name": "a", "key": KEY_A, "requests_per_s": -1}]}, "positive"),
        ({"keys": [{"name": "a", "key": KEY_A, "request_burst": 3}]}, "needs 'requests_per_s'"),
        ({"keys": [{"name": "a", "key": KEY_A, "rpm": 3}]}, "unknown field"),
        ([1, 2], "'keys' list"),
    ]:
        with pytest.raises(AuthConfigError, match=why):
            parse_keys(bad, "test")


def test_a_keys_file_that_cannot_be_read_names_path_and_reason(tmp_path, monkeypatch):
    from stack.config import AuthConfig

    missing = tmp_path / "nope.yaml"
    with pytest.raises(AuthConfigError, match=rf"{missing}: cannot read: No such file"):
        load_keys(AuthConfig(keys_file=str(missing)))
    with pytest.raises(AuthConfigError, match="Is a directory"):
        load_keys(AuthConfig(keys_file=str(tmp_path)))
    monkeypatch.delenv("SMETRIC_TEST_NO_KEYS", raising=False)
    with pytest.raises(AuthConfigError, match="SMETRIC_TEST_NO_KEYS: the environment variable is not set"):
        load_keys(AuthConfig(keys_env="SMETRIC_TEST_NO_KEYS"))
    monkeypatch.setenv("SMETRIC_TEST_NO_KEYS", "keys: [")
    with pytest.raises(AuthConfigError, match="not valid YAML"):
        load_keys(AuthConfig(keys_env="SMETRIC_TEST_NO_KEYS"))
    monkeypatch.setenv("SMETRIC_TEST_NO_KEYS", yaml.safe_dump(_keys_doc()))
    assert len(load_keys(AuthConfig(keys_env="SMETRIC_TEST_NO_KEYS"))) == 4


def test_router_with_an_unreadable_key_file_exits_nonzero(tmp_path):
    missing = tmp_path / "secrets" / "keys.yaml"
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "router": {"port": 1, "auth": {"keys_file": str(missing)}},
                "prefill": [{"url": "http://127.0.0.1:9"}],
            }
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "router", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert str(missing) in r.stderr and "No such file or directory" in r.stderr, r.stderr


def test_local_limits_refuse_and_recover():
    now = [0.0]
    lim = LocalLimiter(clock=lambda: now[0])
    rate = Limits.of(requests_per_s=2, request_burst=2)
    assert lim.admit("k", rate) is None and lim.admit("k", rate) is None
    r = lim.admit("k", rate)
    assert r.reason == "requests" and r.retry_after_s == 1
    now[0] += 0.5  # one token back
    assert lim.admit("k", rate) is None
    tok = Limits.of(prompt_tokens_per_s=100)
    assert lim.admit("t", tok) is None and lim.charge("t", tok, 250) is None  # debt of 150
    r = lim.admit("t", tok)
    assert r.reason == "prompt_tokens" and r.retry_after_s == 2
    now[0] += 2.0
    assert lim.admit("t", tok) is None
    conc = Limits.of(max_concurrency=1)
    assert lim.admit("c", conc) is None and lim.admit("c", conc).reason == "concurrency"
    lim.release("c")
    assert lim.admit("c", conc) is None


# -- 401 / 431 in each API's shape ---------------------------------------------------------------
@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_openai_shape_401(cluster, path):
    cl = cluster.client
    err = _openai_error(cl.post(path, json=_body(path)), 401, "missing_api_key")
    assert "Authorization: Bearer" in err["message"]
    _openai_error(
        cl.post(path, json=_body(path), headers={"Authorization": "Bearer sk-wrong-123456"}),
        401,
        "invalid_api_key",
    )
    _openai_error(
        cl.post(path, json=_body(path), headers={"Authorization": f"Basic {KEY_A}"}), 401, "malformed_api_key"
    )
    _openai_error(
        cl.post(path, json=_body(path), headers={"Authorization": "Bearer"}), 401, "malformed_api_key"
    )
    r = cl.post(path, json=_body(path), headers={"x-api-key": ("sk-" + "\u00e9" * 8).encode()})
    _openai_error(r, 401, "malformed_api_key")
    _openai_error(
        cl.post(path, json=_body(path), headers={"x-api-key": "k" * 300_000}), 431, "header_too_large"
    )
    assert cl.post(path, json=_body(path), headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    assert cl.post(path, json=_body(path), headers={"x-api-key": KEY_A}).status_code == 200


@pytest.mark.parametrize("path", ANTHROPIC_PATHS)
def test_anthropic_shape_401(cluster, path):
    cl = cluster.client
    _anthropic_error(cl.post(path, json=_body(path)), 401, "authentication_error")
    _anthropic_error(
        cl.post(path, json=_body(path), headers={"x-api-key": "sk-wrong-123456"}), 401, "authentication_error"
    )
    _anthropic_error(
        cl.post(path, json=_body(path), headers={"Authorization": KEY_A}), 401, "authentication_error"
    )
    r = cl.post(path, json=_body(path), headers={"Authorization": "Bearer " + "k" * 50_000})
    _anthropic_error(r, 431, "invalid_request_error")
    assert cl.post(path, json=_body(path), headers={"x-api-key": KEY_A}).status_code == 200
    assert cl.post(path, json=_body(path), headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200


def test_health_and_metrics_open_everything_else_needs_a_key(cluster):
    cl = cluster.client
    assert cl.get("/health").status_code == 200
    assert cl.get("/metrics").status_code == 200
    _openai_error(cl.get("/v1/models"), 401)
    _openai_error(cl.get("/no/such/path"), 401)
    assert cl.get("/v1/models", headers={"x-api-key": KEY_A}).status_code == 200
    # the admin API has its own token, and no API key opens it
    assert cl.get("/admin/auth", headers={"x-api-key": KEY_A}).status_code == 401


# -- 429 with Retry-After -------------------------------------------------------------------------
def test_request_rate_429_in_both_shapes(cluster):
    cl = cluster.client
    h = {"Authorization": f"Bearer {KEY_RATE}"}
    assert [cl.post("/v1/chat/completions", json=_body("chat"), headers=h).status_code for _ in range(2)] == [
        200,
        200,
    ]
    r = cl.post("/v1/chat/completions", json=_body("chat"), headers=h)
    err = _openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "requests" and "'rate'" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    r = cl.post("/v1/messages", json=_body("/v1/messages"), headers={"x-api-key": KEY_RATE})
    _anthropic_error(r, 429, "rate_limit_error")
    assert int(r.headers["retry-after"]) >= 1
    # the lighter client endpoints take the same request-rate limit (OpenAI's shape)
    for r in (cl.get("/v1/models", headers=h), cl.post("/v1/tokenize", json={"prompt": "hi"}, headers=h)):
        err = _openai_error(r, 429, "rate_limit_exceeded")
        assert err["type"] == "requests" and int(r.headers["retry-after"]) >= 1
    ok = {"x-api-key": KEY_A}  # a key without limits is not held by another key's
    assert cl.get("/v1/models", headers=ok).status_code == 200
    t = cl.post("/v1/tokenize", json={"prompt": "hi"}, headers=ok)
    assert t.status_code == 200 and t.json()["count"] >= 1, t.text


def test_prompt_token_rate_429_in_both_shapes(cluster):
    cl = cluster.client
    h = {"x-api-key": KEY_TOK}
    # the bucket (burst 50) has tokens: a 300-token prompt passes and leaves a debt
    assert cl.post("/v1/chat/completions", json=_body("chat", words=150), headers=h).status_code == 200
    r = cl.post("/v1/chat/completions", json=_body("chat"), headers=h)
    err = _openai_error(r, 429, "rate_limit_exceeded")
    assert err["type"] == "tokens"
    assert int(r.headers["retry-after"]) >= 100  # ~250 tokens of debt at 1 token/s
    r = cl.post("/v1/messages", json=_body("/v1/messages"), headers=h)
    _anthropic_error(r, 429, "rate_limit_error")


def test_concurrency_429_and_release(model_dir, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(_keys_doc()))
    slow = {"prefill_delay_s": 1.0, "agent_paths": True}
    c = Cluster(model_dir, router={"auth": {"keys_file": str(keys)}}, prefill_kw=slow, decode_kw=slow)
    try:
        h = {"x-api-key": KEY_CONC}
        first = {}
        t = threading.Thread(
            target=lambda: first.setdefault(
                "r", c.client.post("/v1/messages", json=_body("/v1/messages"), headers=h)
            )
        )
        t.start()
        c.wait_for(lambda: any(w.records for w in c.prefill))
        r = c.client.post("/v1/messages", json=_body("/v1/messages"), headers=h)
        _anthropic_error(r, 429, "rate_limit_error")
        assert "concurrent" in r.json()["error"]["message"]
        r = c.client.post("/v1/chat/completions", json=_body("chat"), headers=h)
        _openai_error(r, 429, "rate_limit_exceeded")
        t.join()
        assert first["r"].status_code == 200
        assert c.client.post("/v1/chat/completions", json=_body("chat"), headers=h).status_code == 200
    finally:
        c.close()


# -- metrics, reload ------------------------------------------------------------------------------
def test_metrics_count_by_name_never_the_key(cluster):
    cl = cluster.client
    cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_A})
    cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": "sk-wrong-123456"})
    text = cl.get("/metrics").text
    for k in (KEY_A, KEY_RATE, KEY_TOK, KEY_CONC, "sk-wrong-123456", _sha(KEY_A), _sha(KEY_RATE)):
        assert k not in text
    lines = {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("smetric_key")
    }
    assert lines['smetric_key_requests_total{key="team-a"}'] >= 1
    assert lines['smetric_key_prompt_tokens_total{key="team-a"}'] >= 1
    assert lines['smetric_key_rejections_total{key="-",reason="invalid"}'] >= 1
    assert lines['smetric_key_inflight{key="team-a"}'] == 0
    assert 'smetric_requests_total{endpoint="chat",status="401"}' in text


def test_reload_without_restart(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "old", "key": KEY_A}]}))
    c = Cluster(model_dir, router={"auth": {"keys_file": str(keys)}}, admin_env=ADMIN_ENV)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        cl = c.client
        assert (
            cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_A}).status_code
            == 200
        )
        assert cl.post("/admin/auth/reload").status_code == 401
        keys.write_text(yaml.safe_dump({"keys": [{"name": "new", "key": KEY_RATE, "requests_per_s": 100}]}))
        r = cl.post("/admin/auth/reload", headers=admin)
        assert r.status_code == 200 and [k["name"] for k in r.json()["keys"]] == ["new"]
        assert r.json()["keys"][0]["limits"]["requests_per_s"] == 100
        assert KEY_RATE not in r.text and _sha(KEY_RATE) not in r.text
        _openai_error(cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_A}), 401)
        assert (
            cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_RATE}).status_code
            == 200
        )
        # a broken file is refused and the keys in use stay
        keys.write_text("keys: [")
        r = cl.post("/admin/auth/reload", headers=admin)
        assert r.status_code == 422 and str(keys) in r.json()["error"]["message"]
        assert (
            cl.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_RATE}).status_code
            == 200
        )
        keys.unlink()
        r = cl.post("/admin/auth/reload", headers=admin)
        assert r.status_code == 422 and "No such file" in r.json()["error"]["message"]
        assert cl.get("/admin/auth", headers=admin).json()["keys"][0]["name"] == "new"
    finally:
        c.close()


def test_protect_metrics(model_dir, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(_keys_doc()))
    c = Cluster(model_dir, router={"auth": {"keys_file": str(keys), "protect_metrics": True}})
    try:
        _openai_error(c.client.get("/metrics"), 401)
        assert c.client.get("/metrics", headers={"x-api-key": KEY_A}).status_code == 200
        assert c.client.get("/health").status_code == 200
    finally:
        c.close()


# -- the workers' keys ----------------------------------------------------------------------------
def test_workers_get_the_worker_key_never_the_clients(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SMETRIC_TEST_WORKER_KEY", "worker-key-123")
    monkeypatch.setenv("SMETRIC_TEST_WORKER_ADMIN", "worker-admin-456")
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(_keys_doc()))
    auth = {
        "keys_file": str(keys),
        "worker_api_key_env": "SMETRIC_TEST_WORKER_KEY",
        "worker_admin_api_key_env": "SMETRIC_TEST_WORKER_ADMIN",
    }
    c = Cluster(model_dir, router={"auth": auth}, decode_kw={"fail": "400"})
    try:
        r = c.client.post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_A})
        assert r.status_code == 400  # the decode worker refuses it: prefill is aborted
        c.wait_for(lambda: any(w.aborts for w in c.prefill))
        sent = [h for w in c.prefill + c.decode for h in w.headers]
        assert sent and all(h.get("authorization") == "Bearer worker-key-123" for h in sent)
        assert all(KEY_A not in str(h) for h in sent)
    finally:
        c.close()


def test_a_named_worker_key_that_is_unset_stops_the_router(model_dir, monkeypatch):
    monkeypatch.delenv("SMETRIC_TEST_WORKER_KEY_UNSET", raising=False)
    with pytest.raises(AuthConfigError, match="SMETRIC_TEST_WORKER_KEY_UNSET"):
        Cluster(model_dir, router={"auth": {"worker_api_key_env": "SMETRIC_TEST_WORKER_KEY_UNSET"}})


# -- the SDKs see their own error classes ----------------------------------------------------------
def test_sdks_raise_their_auth_and_rate_limit_errors(cluster):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    url = cluster.url
    with openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong-123456", max_retries=0) as oc:
        with pytest.raises(openai.AuthenticationError):
            oc.chat.completions.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
    with anthropic.Anthropic(base_url=url, api_key="sk-wrong-123456", max_retries=0) as ac:
        with pytest.raises(anthropic.AuthenticationError):
            ac.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with anthropic.Anthropic(base_url=url, api_key=KEY_A, max_retries=0) as ac:
        raw = ac.messages.with_raw_response.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
        assert raw.status_code == 200  # the SDK's own x-api-key header passes
    with anthropic.Anthropic(base_url=url, api_key=KEY_TOK, max_retries=0) as ac:
        big = [{"role": "user", "content": "lots of words " * 100}]
        with pytest.raises(anthropic.RateLimitError):
            for _ in range(3):
                ac.messages.create(model="tiny", max_tokens=2, messages=big)


# -- limits across router replicas (a real Redis) --------------------------------------------------
class _Replicas:
    """Fake PD workers and two router replicas over them, sharing ``redis_url`` (None: two
    independent routers), with the keys of ``keys``."""

    def __init__(self, model_dir, redis_url, keys, delay_s=0.0):
        from stack.config import parse_config
        from stack.prefill_router.service import create_app
        from stack.worker.fake import FakeWorker, KVLink, ServerThread

        link = KVLink()
        kw = {"link": link, "prefill_delay_s": delay_s, "agent_paths": True}
        self.workers = [
            FakeWorker(mode="prefill", name="p0", **kw),
            FakeWorker(mode="decode", name="d0", **kw),
        ]
        self.servers = [ServerThread(w).start() for w in self.workers]
        self.apps, self.routers = [], []
        for i in range(2):
            rc = {
                "policy": "round-robin",
                "health_interval_s": 0.5,
                "redis_url": redis_url,
                "replica_id": f"r{i}",
                "redis_heartbeat_s": 0.2,
                "redis_ttl_s": 1.0,
                "auth": {"keys_file": str(keys)},
            }
            cfg = parse_config(
                {
                    "model": {
                        "name": "tiny",
                        "path": str(model_dir),
                        "page_size": 16,
                        "context_length": 8192,
                    },
                    "router": rc,
                    "prefill": [{"url": self.servers[0].url, "bootstrap_port": 9000}],
                    "decode": [{"url": self.servers[1].url}],
                }
            )
            app = create_app(cfg)
            self.apps.append(app)
            self.routers.append(ServerThread(app).start())
        self.clients = [httpx.Client(base_url=r.url, timeout=30) for r in self.routers]
        if redis_url:  # both replicas reach Redis before the first request
            deadline = time.monotonic() + 10
            while not all(a.state.router.shared.up for a in self.apps):
                assert time.monotonic() < deadline, "shared state never came up"
                time.sleep(0.05)

    def close(self):
        for c in self.clients:
            c.close()
        for s in self.routers + self.servers:
            s.stop()


def _replica_keys(tmp_path):
    p = tmp_path / "keys.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "rate", "key": KEY_RATE, "requests_per_s": 0.05, "request_burst": 4},
                    {"name": "tokens", "key": KEY_TOK, "prompt_tokens_per_s": 1, "prompt_token_burst": 50},
                    {"name": "conc", "key": KEY_CONC, "max_concurrency": 1},
                ]
            }
        )
    )
    return p


def _statuses(rep: _Replicas, key: str, n: int, path: str = "/v1/chat/completions") -> list[int]:
    """``n`` requests of ``key``, alternating between the replicas."""
    return [
        rep.clients[i % 2].post(path, json=_body(path), headers={"x-api-key": key}).status_code
        for i in range(n)
    ]


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "independent"])
def test_request_rate_holds_across_replicas(model_dir, tmp_path, redis_server, shared):
    rep = _Replicas(model_dir, redis_server.url if shared else None, _replica_keys(tmp_path))
    try:
        got = _statuses(rep, KEY_RATE, 10)
        # the burst of 4 is the cluster's with Redis; each replica's own without it (the control)
        assert got.count(200) == (4 if shared else 8), got
        assert set(got) == {200, 429}
        if shared:
            r = redis_server.client()
            assert r.exists("smetric:auth:rate:req") and not any(KEY_RATE.encode() in k for k in r.keys("*"))
    finally:
        rep.close()


def test_prompt_tokens_and_concurrency_hold_across_replicas(model_dir, tmp_path, redis_server):
    rep = _Replicas(model_dir, redis_server.url, _replica_keys(tmp_path), delay_s=1.0)
    try:
        # a 300-token prompt on r0 leaves the key in debt: r1 refuses the next one
        body = _body("chat", words=150)
        assert (
            rep.clients[0].post("/v1/chat/completions", json=body, headers={"x-api-key": KEY_TOK}).status_code
            == 200
        )
        r = rep.clients[1].post("/v1/messages", json=_body("/v1/messages"), headers={"x-api-key": KEY_TOK})
        _anthropic_error(r, 429, "rate_limit_error")
        # one request in flight on r0: r1 refuses a second one of the same key, then takes it
        first = {}
        t = threading.Thread(
            target=lambda: first.setdefault(
                "r",
                rep.clients[0].post(
                    "/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_CONC}
                ),
            )
        )
        t.start()
        deadline = time.monotonic() + 10
        while not redis_server.client().hvals("smetric:auth:conc:conc"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = rep.clients[1].post("/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_CONC})
        assert _openai_error(r, 429, "rate_limit_exceeded")["type"] == "requests"
        t.join()
        assert first["r"].status_code == 200
        deadline = time.monotonic() + 10  # the release is written in the background
        while True:
            r = rep.clients[1].post(
                "/v1/chat/completions", json=_body("chat"), headers={"x-api-key": KEY_CONC}
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200
    finally:
        rep.close()
