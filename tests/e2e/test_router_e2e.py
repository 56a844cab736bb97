"""The router end to end against fake SGLang workers on loopback (real HTTP, real ZMQ)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from stack.models.tiny import build_tiny_model
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-admin"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_cluster(model_dir, monkeypatch):
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", TOKEN)
    made = []

    def make(**kw):
        c = Cluster(model_dir, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def session(i: int, turns: int = 1) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    for t in range(turns):
        msgs.append(
            {"role": "user", "content": f"session {i} task {t}: fix the bug in module_{i}.py please " * 12}
        )
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"ok {t}"})
    return msgs


def session_of(body: dict) -> int | None:
    for m in body.get("messages", []):
        if m["role"] == "user":
            return int(m["content"].split()[1])
    return None


def publish_prompt(c: Cluster, pub_idx: int, messages: list[dict], seed: int) -> int:
    """Publish BlockStored events for the prompt of ``messages`` as SGLang 0.5.23 does."""
    tok = c.state.features.tok
    ids = tok.encode(tok.render(messages)).tokens
    bs = c.cfg.model.page_size
    n = len(ids) // bs
    rng = random.Random(seed)
    hashes = [rng.randrange(-(2**63), 2**63) for _ in range(n)]
    # two events, the second chained on the first's last hash
    half = n // 2
    ev1 = {
        "type": "BlockStored",
        "block_hashes": hashes[:half],
        "parent_block_hash": None,
        "token_ids": ids[: half * bs].tolist(),
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
    }
    ev2 = dict(
        ev1,
        block_hashes=hashes[half:],
        parent_block_hash=hashes[half - 1],
        token_ids=ids[half * bs : n * bs].tolist(),
    )
    c.publishers[pub_idx].send([ev1, ev2])
    return n


def metric(c: Cluster, name: str, **labels) -> float:
    text = c.client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_first_turns_spread_and_follow_ups_stick_via_kv_events(make_cluster):
    # decode answers after prefill, as a real one waiting for the KV does
    c = make_cluster(
        n_prefill=4,
        n_decode=1,
        kv_events=True,
        prefill_kw={"prefill_delay_s": 0.4},
        decode_kw={"prefill_delay_s": 0.4},
    )
    c.wait_subscribed()
    with ThreadPoolExecutor(4) as ex:
        rs = list(
            ex.map(lambda i: c.client.post("/v1/chat/completions", json={"messages": session(i)}), range(4))
        )
    assert [r.status_code for r in rs] == [200] * 4
    home = {}
    for pi, w in enumerate(c.prefill):
        for _, body, _ in w.records:
            home[session_of(body)] = pi
    assert sorted(home) == [0, 1, 2, 3]
    assert len(set(home.values())) == 4, f"first turns did not spread: {home}"
    # the engines report the cached prompt blocks over ZMQ
    for s, pi in home.items():
        publish_prompt(c, pi, session(s), seed=s)
    ws = c.prefill_workers()
    c.wait_for(lambda: all(c.state.index.blocks(w.wid) > 0 for w in ws))
    for w in c.prefill + c.decode:
        w.prefill_delay_s = 0.0
        w.records.clear()
    # follow-ups in a scrambled order: each goes back to the worker holding its prefix
    for s in [2, 0, 3, 1]:
        r = c.client.post("/v1/chat/completions", json={"messages": session(s, turns=2)})
        assert r.status_code == 200
    # (the fake decode does not wait for the KV, so the prefill POST may land just after)
    c.wait_for(lambda: sum(len(w.records) for w in c.prefill) == 4)
    for s, pi in home.items():
        got = [session_of(b) for _, b, _ in c.prefill[pi].records]
        assert got == [s], (home, [[session_of(b) for _, b, _ in w.records] for w in c.prefill])
    assert metric(c, "smetric_decisions_total", kind="stick") == 4
    assert metric(c, "smetric_decisions_total", kind="first_turn") == 4
    assert metric(c, "smetric_local_hit_ratio") > 0.3


def test_kv_event_sequence_gap_drops_index(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=1, kv_events=True)
    c.wait_subscribed()
    publish_prompt(c, 0, session(0), seed=1)
    w0 = c.prefill_workers()[0]
    c.wait_for(lambda: c.state.index.blocks(w0.wid) > 0)
    c.publishers[0].send([], seq=1000)  # a gap
    c.wait_for(lambda: c.state.index.blocks(w0.wid) == 0)
    assert metric(c, "smetric_kv_event_gaps_total") == 1


def test_follow_ups_stick_via_routing_history_without_events(make_cluster):
    c = make_cluster(
        n_prefill=3, n_decode=1, prefill_kw={"prefill_delay_s": 1.0}, decode_kw={"prefill_delay_s": 1.0}
    )
    with ThreadPoolExecutor(3) as ex:
        list(ex.map(lambda i: c.client.post("/v1/chat/completions", json={"messages": session(i)}), range(3)))
    home = {session_of(b): pi for pi, w in enumerate(c.prefill) for _, b, _ in w.records}
    assert len(set(home.values())) == 3
    for w in c.prefill + c.decode:
        w.prefill_delay_s = 0.0
        w.records.clear()
    for s in [1, 2, 0]:
        assert c.client.post("/v1/chat/completions", json={"messages": session(s, 2)}).status_code == 200
    c.wait_for(lambda: sum(len(w.records) for w in c.prefill) == 3)
    for s, pi in home.items():
        got = [session_of(b) for _, b, _ in c.prefill[pi].records]
        assert got == [s], (home, [[session_of(b) for _, b, _ in w.records] for w in c.prefill])


def test_pd_bootstrap_fields_identical_and_rooms_unique(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=2)
    for i in range(6):
        assert (
            c.client.post(
                "/v1/chat/completions",
                json={"messages": session(i), "rid": None} if i == 0 else {"messages": session(i)},
            ).status_code
            == 200
        )
    assert (
        c.client.post(
            "/generate", json={"text": "hello world " * 10, "sampling_params": {"max_new_tokens": 4}}
        ).status_code
        == 200
    )
    assert (
        c.client.post("/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 3}).status_code == 200
    )
    r = c.client.post("/generate", json={"text": ["a b c " * 10, "d e f " * 10, "g h " * 10]})
    assert r.status_code == 200
    c.wait_for(lambda: sum(len(w.records) for w in c.prefill) == sum(len(w.records) for w in c.decode))
    pre = {}
    boot_ports = {s.url: 9000 + i for i, s in enumerate(c.servers[:2])}
    for s, w in zip(c.servers[:2], c.prefill, strict=True):
        for path, body, _ in w.records:
            pre[orjson.dumps(body.get("bootstrap_room"))] = (path, body, s.url)
    rooms = []
    for w in c.decode:
        for path, body, _ in w.records:
            key = orjson.dumps(body["bootstrap_room"])
            ppath, pbody, purl = pre[key]
            assert ppath == path and pbody == body  # the very same body on both sides
            room = body["bootstrap_room"]
            if isinstance(room, list):
                assert len(room) == 3 and body["bootstrap_host"] == ["127.0.0.1"] * 3
                assert body["bootstrap_port"] == [boot_ports[purl]] * 3 and len(body["rid"]) == 3
                rooms.extend(room)
            else:
                assert body["bootstrap_host"] == "127.0.0.1" and body["bootstrap_port"] == boot_ports[purl]
                rooms.append(room)
    assert len(rooms) == 11 and len(set(rooms)) == 11
    assert all(0 <= r < 2**63 for r in rooms)


def test_streaming_passes_through_chunk_by_chunk(make_cluster):
    c = make_cluster(n_prefill=1, n_decode=1, decode_kw={"tokens": 4, "chunk_delay_s": 0.15})
    t0 = time.monotonic()
    times, data = [], b""
    with c.client.stream("POST", "/v1/chat/completions", json={"messages": session(0), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            times.append(time.monotonic() - t0)
            data += chunk
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"
    assert b'"usage"' in events[-2]
    assert len(times) >= 4
    assert times[0] < times[-1] - 0.3  # the first token arrived well before the last


def test_failing_prefill_is_ejected_and_request_retried(make_cluster):
    # decode answers only after a while, as a real one waiting for the KV would
    c = make_cluster(n_prefill=2, n_decode=1, decode_kw={"prefill_delay_s": 0.2})
    c.prefill[0].fail = "500"  # its /health passes: only its calls fail
    r = c.client.post("/v1/chat/completions", json={"messages": session(0)})
    assert r.status_code == 200
    c.wait_for(lambda: len(c.prefill[0].records) == 1 and len(c.prefill[1].records) == 1)
    failed_rid = c.prefill[0].records[0][1]["rid"]
    c.wait_for(lambda: failed_rid in c.decode[0].aborts)  # the decode twin was aborted
    p0 = c.prefill_workers()[0]
    n = c.cfg.router.health_failures  # failed calls in a row that eject a worker
    assert n > 1 and p0.healthy and p0.call_fails == 1  # one failed call is not enough
    for i in range(1, 40):  # every request is answered; p0's n-th failed call in a row ejects it
        assert c.client.post("/v1/chat/completions", json={"messages": session(i)}).status_code == 200
        if len(c.prefill[0].records) == n:
            break
    assert len(c.prefill[0].records) == n
    assert not p0.healthy
    assert metric(c, "smetric_retries_total") == n
    assert metric(c, "smetric_ejections_total") == 1
    # while ejected it gets nothing
    for i in range(3):
        assert c.client.post("/v1/chat/completions", json={"messages": session(50 + i)}).status_code == 200
    assert len(c.prefill[0].records) == n
    c.prefill[0].fail = None
    c.wait_for(lambda: p0.healthy)  # readmitted by the health check


def test_unreachable_prefill_is_ejected(make_cluster):
    c = make_cluster(
        n_prefill=1,
        n_decode=1,
        dead_prefill=1,
        decode_kw={"prefill_delay_s": 0.2},
        router={"health_interval_s": 30},
    )
    dead = [w for w in c.state.registry.workers.values() if w.url in c.dead_urls]
    assert dead
    # every request is answered (retried on the live worker); the dead one is ejected once its
    # failures in a row (calls, and the health check at start) reach router.health_failures
    for i in range(40):
        r = c.client.post("/v1/chat/completions", json={"messages": session(i)})
        assert r.status_code == 200
        if not dead[0].healthy:
            break
    assert not dead[0].healthy
    assert metric(c, "smetric_retries_total") <= c.cfg.router.health_failures


def test_failing_decode_aborts_prefill_and_retries(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=2)
    c.decode[0].fail = "500"
    r = c.client.post("/v1/chat/completions", json={"messages": session(0)})
    assert r.status_code == 200 and r.json()["worker"] == "d1", r.text  # the retry's error, if any
    rid = c.decode[0].records[0][1]["rid"]
    c.wait_for(lambda: any(rid in w.aborts for w in c.prefill))


def test_both_attempts_fail_gives_clean_502(make_cluster):
    c = make_cluster(
        n_prefill=2,
        n_decode=1,
        prefill_kw={"fail": "500"},
        decode_kw={"prefill_delay_s": 0.2},
        router={"health_interval_s": 30},
    )
    n = c.cfg.router.health_failures
    for i in range(n + 1):  # each request fails on both workers: a clean error every time
        r = c.client.post("/v1/chat/completions", json={"messages": session(i)})
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if i == 0 or r.status_code == 502:
            assert r.status_code == 502 and err["type"] == "upstream_error"
        else:  # its retry found the other worker ejected
            assert r.status_code == 503 and err["code"] == "no_worker" and r.headers["retry-after"] == "1"
    # failed calls eject a worker, never the last healthy one (its health checks decide on it):
    # a failure on the router's side cannot take the whole pool out
    assert [w.healthy for w in c.prefill_workers()].count(True) == 1
    assert metric(c, "smetric_ejections_total") == 1
    assert c.client.get("/health").status_code == 200


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


def test_client_errors_are_well_formed(make_cluster):
    c = make_cluster(n_prefill=1, n_decode=1, router={"max_body_bytes": 60000})
    post = c.client.post
    _err(post("/v1/chat/completions", content=b"{not json"), 400)
    _err(post("/v1/chat/completions", content=b"[1, 2]"), 400)
    _err(post("/v1/chat/completions", content=b""), 400)
    assert _err(post("/v1/chat/completions", json={}), 400)["param"] == "messages"
    _err(post("/v1/chat/completions", json={"messages": "hi"}), 400)
    _err(post("/v1/chat/completions", json={"messages": []}), 400)
    _err(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]}), 400)
    _err(post("/v1/chat/completions", json={"messages": session(0), "stream": "yes"}), 400)
    _err(post("/v1/chat/completions", json={"messages": session(0), "max_tokens": -1}), 400)
    _err(post("/v1/completions", json={"prompt": ""}), 400)
    _err(post("/v1/completions", json={}), 400)
    _err(post("/generate", json={"sampling_params": {}}), 400)
    _err(post("/generate", json={"text": "hi", "sampling_params": 3}), 400)
    _err(post("/v1/chat/completions", content=b'{"messages": "' + b"x" * 70000 + b'"}'), 413)
    e = _err(post("/v1/completions", json={"prompt": list(range(8200))}), 400)
    assert e["code"] == "context_length_exceeded"
    _err(c.client.get("/nope"), 404)
    _err(c.client.get("/v1/chat/completions"), 405)
    # a worker rejecting the request: its 4xx reaches the client, well-formed
    c.decode[0].fail = "400"
    assert (
        _err(post("/v1/chat/completions", json={"messages": session(0)}), 400)["message"] == "worker says no"
    )
    assert metric(c, "smetric_retries_total") == 0


def test_admin_api_requires_token_and_manages_workers(make_cluster, model_dir):
    from stack.worker.fake import FakeWorker, ServerThread

    c = make_cluster(n_prefill=1, n_decode=1)
    get = c.client.get
    assert _err(get("/admin/workers"), 401)["type"] == "authentication_error"
    _err(get("/admin/workers", headers={"Authorization": "Bearer wrong"}), 401)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    ws = get("/admin/workers", headers=auth).json()["workers"]
    assert sorted(w["role"] for w in ws) == ["decode", "prefill"]
    extra = FakeWorker(mode="prefill", name="px", link=c.link)
    srv = ServerThread(extra).start()
    try:
        r = c.client.post(
            "/admin/workers", json={"role": "prefill", "url": srv.url, "bootstrap_port": 9555}, headers=auth
        )
        assert r.status_code == 201
        _err(c.client.post("/admin/workers", json={"role": "prefill", "url": srv.url}, headers=auth), 409)
        _err(c.client.post("/admin/workers", json={"role": "x", "url": srv.url}, headers=auth), 422)
        _err(c.client.post("/admin/workers", json={"url": "ftp://x"}, headers=auth), 422)
        _err(c.client.post("/admin/workers", json={"url": srv.url}), 401)
        # remove the original prefill worker: traffic goes to the new one
        orig = c.servers[0].url
        r = c.client.request("DELETE", "/admin/workers", json={"url": orig, "role": "prefill"}, headers=auth)
        assert r.status_code == 200
        assert c.client.post("/v1/chat/completions", json={"messages": session(0)}).status_code == 200
        c.wait_for(lambda: len(extra.records) == 1)
        assert extra.records[0][1]["bootstrap_port"] == 9555
        _err(c.client.request("DELETE", "/admin/workers", json={"url": orig}, headers=auth), 404)
    finally:
        srv.stop()


def test_admin_disabled_without_token_env(make_cluster, monkeypatch):
    monkeypatch.delenv("SMETRIC_TEST_ADMIN_TOKEN")
    c = make_cluster(n_prefill=1, n_decode=1)
    _err(c.client.get("/admin/workers", headers={"Authorization": "Bearer x"}), 401)
    _err(c.client.get("/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}), 401)


def test_load_polling_new_and_old_shapes(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=1, prefill_kw={"waiting_report": 3})
    c.prefill[1].old_loads = True
    c.prefill[1].waiting_report = 7
    ws = c.prefill_workers()
    c.wait_for(lambda: ws[0].polled_waiting == 3 and ws[1].polled_running == 7)


def test_endpoints_models_health_metrics_colocated(make_cluster):
    c = make_cluster(n_prefill=2, n_decode=0)  # colocated: no PD hand-off
    assert c.client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert c.client.get("/health").json()["status"] == "ok"
    r = c.client.post("/v1/completions", json={"prompt": "hello " * 30})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    body = c.prefill[0].records[-1][1] if c.prefill[0].records else c.prefill[1].records[-1][1]
    assert "bootstrap_room" not in body
    with c.client.stream("POST", "/generate", json={"text": "hi there " * 10, "stream": True}) as s:
        assert b"[DONE]" in b"".join(s.iter_raw())
    m = c.client.get("/metrics").text
    for name in (
        "smetric_requests_total",
        "smetric_decisions_total",
        "smetric_local_hit_ratio",
        "smetric_worker_queued_tokens",
        "smetric_ttft_seconds_bucket",
    ):
        assert name in m
