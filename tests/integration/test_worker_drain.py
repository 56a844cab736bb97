"""A worker that drains (stack/prefill_router/worker_drain.py): after ``POST
/admin/workers/drain`` it gets no new request, the request it holds runs to its end, and then
it leaves the pool; at its deadline it leaves whatever it holds; errors in the admin API's shape."""

from __future__ import annotations

import threading
import time

import pytest

from stack.models.tiny import build_tiny_model
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(90)

TOKEN = "drain-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "drain me"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cluster(model_dir, monkeypatch):
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", TOKEN)
    c = Cluster(
        model_dir,
        n_prefill=2,
        n_decode=2,
        policy="least-load",
        prefill_kw={"prefill_delay_s": 1.5},
        router={"health_timeout_s": 5.0},
    )
    yield c
    c.close()


def _listed(c: Cluster) -> dict[str, dict]:
    r = c.client.get("/admin/workers", headers=AUTH)
    assert r.status_code == 200
    return {w["url"]: w for w in r.json()["workers"]}


def _calls(w) -> int:
    return sum(1 for p, _, _ in w.records if p != "/health")


def _in_background(c: Cluster, out: list) -> threading.Thread:
    def go():
        out.append(c.client.post("/v1/chat/completions", json=CHAT))

    t = threading.Thread(target=go)
    t.start()
    return t


def _busy_worker(c: Cluster, workers):
    """The worker of ``workers`` that holds the one request sent (waits for it)."""
    t0 = time.monotonic()
    while True:
        busy = [w for w in workers if w.active]
        if busy:
            return busy[0]
        assert time.monotonic() - t0 < 10, "no worker got the request"
        time.sleep(0.02)


def _wait(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met"
        time.sleep(0.02)


def test_a_drained_worker_finishes_its_request_takes_no_new_one_then_leaves(cluster):
    c = cluster
    out: list = []
    t = _in_background(c, out)
    p = _busy_worker(c, c.prefill)
    url = next(s.url for s, w in zip(c.servers, c.prefill + c.decode, strict=True) if w is p)
    r = c.client.post("/admin/workers/drain", json={"url": url, "role": "prefill"}, headers=AUTH)
    assert r.status_code == 202 and r.json()["draining"]["draining"] is True
    listed = _listed(c)
    assert listed[url]["draining"] is True and listed[url]["inflight"] >= 1  # still there
    m = c.client.get("/metrics").text
    assert f'smetric_worker_draining{{role="prefill",worker="{url}"}} 1.0' in m
    other = next(w for w in c.prefill if w is not p)
    before = _calls(other), _calls(p)
    for _ in range(3):  # new requests: the other prefill worker only
        assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert _calls(other) == before[0] + 3 and _calls(p) == before[1]
    t.join(20)
    assert out[0].status_code == 200 and out[0].json()["choices"][0]["message"]["content"]
    _wait(lambda: url not in _listed(c), timeout=5)  # removed once idle
    assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_drain_deadline_removes_a_worker_that_still_holds_work(cluster):
    c = cluster
    out: list = []
    t = _in_background(c, out)
    p = _busy_worker(c, c.prefill)
    wid = next(w["id"] for u, w in _listed(c).items() if w["role"] == "prefill" and w["inflight"])
    r = c.client.post(f"/admin/workers/{wid}/drain?timeout_s=0.3", headers=AUTH)
    assert r.status_code == 202
    url = r.json()["draining"]["url"]
    _wait(lambda: url not in _listed(c), timeout=3)
    assert p.active  # removed at its deadline while its request still ran
    t.join(20)
    assert out[0].status_code == 200  # the request held still got its answer


def test_a_drained_decode_worker_gets_no_new_request(cluster):
    c = cluster
    d0, d1 = c.decode
    url0 = c.servers[2].url
    r = c.client.post("/admin/workers/drain", json={"url": url0}, headers=AUTH)
    assert r.status_code == 202
    n0, n1 = _calls(d0), _calls(d1)
    for _ in range(3):
        assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert _calls(d0) == n0 and _calls(d1) == n1 + 3
    _wait(lambda: url0 not in _listed(c), timeout=5)


def test_drain_errors(cluster):
    c = cluster
    assert c.client.post("/admin/workers/drain", json={"url": c.servers[0].url}).status_code == 401
    r = c.client.post("/admin/workers/drain", json={"url": "http://10.9.9.9:1"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    for bad in (0, -1, "soon", True):
        r = c.client.post(
            "/admin/workers/drain", json={"url": c.servers[0].url, "timeout_s": bad}, headers=AUTH
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout_s", bad
    assert c.client.post("/admin/workers/0/drain?timeout_s=x", headers=AUTH).status_code == 400
    assert all(not w["draining"] for w in _listed(c).values())  # nothing was started
