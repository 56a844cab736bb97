"""The replay sizes prompts with the target's tokenizer: the router (and the emulated worker)
answer SGLang's ``/model_info`` and ``/v1/tokenize`` with their own counts, and the replay
refuses to start when the target counts its probe prompts otherwise."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from stack.models.tiny import build_tiny_model
from stack.replay.builder import Vocab
from stack.replay.driver import Replay, ReplayConfig
from stack.replay.tokcheck import TokenizerMismatch, check_tokenizer, probes
from stack.sim.load import LoadSpec
from support.router_harness import Cluster
from support.traces import linear_sessions

pytestmark = pytest.mark.timeout(90)

SGLANG_MODEL_INFO = {
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "disaggregation_mode",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(tiny):
    c = Cluster(tiny, n_prefill=1, n_decode=0, router={"health_interval_s": 30})
    yield c
    c.close()


def test_router_model_info_and_tokenize_like_sglang(cluster, tiny):
    c = cluster
    info = c.client.get("/model_info").json()
    assert SGLANG_MODEL_INFO <= set(info)
    assert info["tokenizer_path"] == str(tiny) and info["served_model_name"] == "tiny"
    assert info["max_model_len"] == 8192
    assert c.client.get("/get_model_info").json() == info
    fx = c.state.features
    text = "the router counts these tokens " * 40
    for path in ("/v1/tokenize", "/tokenize"):
        r = c.client.post(path, json={"prompt": text})
        assert r.status_code == 200, r.text
        out = r.json()
        assert set(out) == {"tokens", "count", "max_model_len"}
        f = fx.prompt(text)
        assert out["count"] == f.prompt_tokens == len(out["tokens"]) and out["tokens"] == f.tokens.tolist()
    r = c.client.post("/v1/tokenize", json={"prompt": ["a b c", text]}).json()
    assert r["count"] == [fx.prompt("a b c").prompt_tokens, fx.prompt(text).prompt_tokens]
    assert [len(t) for t in r["tokens"]] == r["count"]
    msgs = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    r = c.client.post("/v1/tokenize", json={"messages": msgs}).json()
    assert r["count"] == fx.chat({"messages": msgs}).prompt_tokens  # what routing and the context check see
    plain = c.client.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["count"] == len(fx.tok.encode(text).tokens)


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {"prompt": 3}, {"prompt": []},
     {"messages": "x"}, {"prompt": "x", "add_special_tokens": "no"}],
)  # fmt: skip
def test_router_tokenize_errors_are_openai_400(cluster, body):
    r = cluster.client.post("/v1/tokenize", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    bad = cluster.client.post(
        "/v1/tokenize", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_router_without_tokenizer_says_so():
    c = Cluster(None, n_prefill=1, n_decode=0, router={"health_interval_s": 30})
    try:
        assert c.client.get("/model_info").json()["tokenizer_path"] is None
        r = c.client.post("/v1/tokenize", json={"prompt": "x"})
        assert r.status_code == 501 and r.json()["error"]["code"] == "no_tokenizer"
    finally:
        c.close()


def test_emulated_worker_model_info_and_tokenize(tiny):
    from fastapi.testclient import TestClient

    from stack.worker.http.app import build_app
    from stack.worker.settings import WorkerSettings

    app, w = build_app(WorkerSettings(model="tiny", tokenizer=str(tiny), mode="colocated"))
    with TestClient(app) as client:
        info = client.get("/model_info").json()
        assert SGLANG_MODEL_INFO <= set(info) and info["tokenizer_path"] == str(tiny)
        text = "the worker counts these " * 30
        out = client.post("/v1/tokenize", json={"prompt": text}).json()
        assert out["count"] == len(w.engine.tokenizer.encode_prompt(text)) == len(out["tokens"])
        msgs = [{"role": "user", "content": text}]
        out = client.post("/v1/tokenize", json={"messages": msgs}).json()
        assert out["count"] == len(w.engine.tokenizer.encode_chat({"messages": msgs}))
        r = client.post("/tokenize", json={})
        assert r.status_code == 400 and "Exactly one" in r.json()["message"]


def _check(url: str, vocab: Vocab, tokenizer: str | None):
    async def go():
        async with httpx.AsyncClient(base_url=url) as client:
            return await check_tokenizer(client, vocab, tokenizer)

    return asyncio.run(go())


def test_check_accepts_the_targets_tokenizer_and_refuses_the_builtin_words(cluster, tiny):
    chk = _check(cluster.url, Vocab.from_tokenizer(tiny), str(tiny))
    assert chk.checked and chk.target_tokenizer == str(tiny)
    assert all(p["ok"] and p["target"] == p["intended"] for p in chk.probes)  # exact: one token per word
    with pytest.raises(TokenizerMismatch) as ei:
        _check(cluster.url, Vocab.builtin(), None)
    msg = str(ei.value)
    assert f"--tokenizer {tiny}" in msg and "built-in word list" in msg
    # the builtin words are several tokens each in the tiny vocabulary: what blew the context
    n = cluster.state.features.tok.encode(probes(Vocab.builtin())[-1][0]).tokens
    assert len(n) > 1.5 * 2048


def test_check_tolerates_targets_without_the_endpoints(tmp_path):
    from stack.worker.fake import FakeWorker, ServerThread

    srv = ServerThread(FakeWorker(mode="colocated", name="f")).start()  # /model_info, no /v1/tokenize
    try:
        chk = _check(srv.url, Vocab.builtin(), None)
        assert not chk.checked and chk.model_info and any("tokenize" in w for w in chk.warnings)
    finally:
        srv.stop()


def test_replay_refuses_a_tokenizer_mismatch_and_runs_with_the_right_one(cluster, tiny, tmp_path):
    trace = linear_sessions(tmp_path / "t.jsonl", sessions=2, turns=2, first_blocks=4, growth=2, think=1.0)
    cfg = ReplayConfig(
        target=cluster.url,
        trace=str(trace),
        load=LoadSpec(session_rate=1.0, duration=2.0, warmup=0.0, seed=0),
        time_factor=0.05,
        request_timeout=10.0,
        metrics_url="",
    )
    with pytest.raises(TokenizerMismatch):
        asyncio.run(Replay(cfg).run())
    assert cluster.client.get("/metrics").status_code == 200
    cfg.tokenizer = str(tiny)
    m = asyncio.run(Replay(cfg).run())
    assert m["tokenizer_check"]["checked"] and m["errors"] == 0, m.get("error_examples")
    cfg.tokenizer, cfg.check_tokenizer = None, False  # the escape hatch
    m = asyncio.run(Replay(cfg).run())
    assert m["tokenizer_check"] is None
