"""``/v1/embeddings`` end to end: the router routes it to a colocated pool worker, or under PD to
a prefill worker alone (no decode half, no bootstrap fields); the emulator answers OpenAI's
shape with a deterministic unit vector; bad input is a 400 in OpenAI's error shape."""

from __future__ import annotations

import math

import httpx
import pytest

from stack.config import parse_config
from stack.models.tiny import build_tiny_model
from stack.prefill_router.service import create_app
from stack.worker.fake import ServerThread
from stack.worker.http.app import build_app
from stack.worker.http.shapes.embeddings import DIM
from stack.worker.settings import WorkerSettings
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)

BAD_INPUTS = [
    {},  # no input
    {"input": ""},
    {"input": []},
    {"input": [[]]},
    {"input": ["a", 1]},
    {"input": [1, "a"]},
    {"input": [[1, 2], "a"]},
    {"input": {"text": "a"}},
    {"input": 7},
    {"input": [-1, 2]},
    {"input": "hi", "model": 3},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _check_list(obj: dict, n: int) -> list[list[float]]:
    assert obj["object"] == "list"
    assert isinstance(obj["model"], str)
    assert [d["index"] for d in obj["data"]] == list(range(n))
    assert all(d["object"] == "embedding" for d in obj["data"])
    u = obj["usage"]
    assert u["prompt_tokens"] == u["total_tokens"] > 0
    vecs = [d["embedding"] for d in obj["data"]]
    for v in vecs:
        assert len(v) == DIM and math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-9)
    return vecs


def _check_openai_error(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] in ("input", "model")


@pytest.mark.parametrize("n_decode", [0, 1])
def test_router_routes_embeddings_without_a_decode_half(model_dir, n_decode):
    c = Cluster(model_dir, n_prefill=2, n_decode=n_decode)
    try:
        for body, n in [
            ({"model": "tiny", "input": "hello world"}, 1),
            ({"input": ["a b c", "d e"]}, 2),
            ({"input": [1, 2, 3, 4]}, 1),
            ({"input": [[1, 2], [3, 4, 5]]}, 2),
        ]:
            r = c.client.post("/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            _check_list(r.json(), n)
        sent = [rec for w in c.prefill for rec in w.records]
        assert [p for p, _, _ in sent] == ["/v1/embeddings"] * 4
        for _, req, _ in sent:  # sent to one worker alone: no PD fields; a rid per prompt
            assert not any(k.startswith("bootstrap_") for k in req)
            assert "priority" not in req
            inp = req["input"]
            batch = isinstance(inp, list) and isinstance(inp[0], str | list)
            assert isinstance(req["rid"], list) == batch and (not batch or len(req["rid"]) == len(inp))
        assert all(not w.records for w in c.decode)
        # the pool's accounting is undone when the answer ends
        assert all(not w.queued for w in c.prefill_workers())
        m = c.client.get("/metrics").text
        assert 'smetric_requests_total{endpoint="embeddings",status="200"} 4.0' in m
    finally:
        c.close()


def test_router_answers_bad_embeddings_input_400_openai_shaped(model_dir):
    c = Cluster(model_dir, n_prefill=1, n_decode=0)
    try:
        for body in BAD_INPUTS:
            _check_openai_error(c.client.post("/v1/embeddings", json=body))
        r = c.client.post("/v1/embeddings", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        long = {"input": list(range(8192))}  # the context length of the harness's model
        r = c.client.post("/v1/embeddings", json=long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert not c.prefill[0].records  # nothing reached the worker
    finally:
        c.close()


def test_emulator_serves_embeddings():
    app, _ = build_app(WorkerSettings(mode="colocated", time_factor=0.001))
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as cl:
            r = cl.post("/v1/embeddings", json={"model": "m", "input": ["hello world", "hello there"]})
            assert r.status_code == 200, r.text
            a, b = _check_list(r.json(), 2)
            assert a != b and r.json()["model"] == "m"
            again = cl.post("/v1/embeddings", json={"input": "hello world"}).json()
            assert _check_list(again, 1)[0] == a  # deterministic from the token ids
            ids = cl.post("/v1/embeddings", json={"input": [[5, 6, 7]]}).json()
            assert ids["usage"]["prompt_tokens"] == 3
            for body in BAD_INPUTS[:-2]:
                r = cl.post("/v1/embeddings", json=body)
                assert r.status_code == 400 and r.json()["object"] == "error", (body, r.text)
    finally:
        srv.stop()


def test_router_in_front_of_the_emulator(model_dir):
    app, _ = build_app(WorkerSettings(mode="colocated", time_factor=0.001, tokenizer=str(model_dir)))
    srv = ServerThread(app).start()
    cfg = parse_config(
        {
            "model": {"name": "tiny", "path": str(model_dir), "context_length": 8192},
            "router": {"mode": "colocated", "health_interval_s": 0.2},
            "prefill": [{"url": srv.url}],
        }
    )
    router = ServerThread(create_app(cfg)).start()
    try:
        with httpx.Client(base_url=router.url, timeout=30) as cl:
            r = cl.post("/v1/embeddings", json={"input": ["a b", "c"]})
            assert r.status_code == 200, r.text
            _check_list(r.json(), 2)
            _check_openai_error(cl.post("/v1/embeddings", json={"input": []}))
    finally:
        router.stop()
        srv.stop()
