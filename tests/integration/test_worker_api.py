"""The emulated worker over HTTP (no Mooncake needed): SGLang's API surface, deterministic
output honouring max_tokens / stop / stream / ignore_eos, cost-model timing, abort, and KV
events that let a subscriber predict every local hit exactly."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from stack.core.cost_model import load_hardware
from stack.launch.loopback import Procs, client
from stack.worker.cache import matchable_pages, page_hashes
from stack.worker.tokenizer import SimpleTokenizer
from support.kv_mirror import server_seq, subscribe_synced

pytestmark = pytest.mark.timeout(120)
PS = 16


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("worker-logs")) as p:
        yield p


@pytest.fixture(scope="module")
def worker(procs):
    # prefill mode without bootstrap fields serves requests alone (prefill + decode)
    return procs.worker("prefill", kv_events=True, page_size=PS, capacity_tokens=1024, time_factor=0.001)


def _sse(resp: httpx.Response) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            d = line[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


def _words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))


def test_api_surface(worker):
    u = worker.url
    assert client().get(u + "/health").status_code == 200
    assert client().get(u + "/health_generate").status_code == 200
    models = client().get(u + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"]
    info = client().get(u + "/server_info").json()
    assert info["page_size"] == PS and info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == worker.bootstrap_port
    loads = client().get(u + "/v1/loads").json()
    assert loads["loads"][0]["num_running_reqs"] == 0 and "num_waiting_reqs" in loads["loads"][0]
    assert loads["loads"][0]["max_total_num_tokens"] == 1024
    # SGLang's older /get_load, which sglang-router 0.3.x's power_of_two polls (sums num_tokens)
    gl = client().get(u + "/get_load").json()
    assert isinstance(gl, list) and gl[0]["num_tokens"] == 0 and gl[0]["num_reqs"] == 0
    m = client().get(u + "/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:cached_tokens_total",
        "smetric_worker_cached_tokens_local_total",
        "smetric_worker_cached_tokens_global_total",
    ):
        assert name in m
    assert client().post(u + "/abort_request", json={"rid": "nope"}).json() == {"aborted": 0}
    r = client().post(u + "/generate", json={"sampling_params": {}})
    assert r.status_code == 400


def test_generate_is_deterministic_and_honours_limits(worker):
    u = worker.url
    body = {"text": _words(50, 1), "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}
    a = client().post(u + "/generate", json=body).json()
    b = client().post(u + "/generate", json=body).json()
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["completion_tokens"] == 7
    assert a["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert a["meta_info"]["prompt_tokens"] == len(SimpleTokenizer().encode(body["text"]))
    # without ignore_eos the output ends by itself (EOS) within the cap
    c = (
        client()
        .post(u + "/generate", json={"text": _words(50, 1), "sampling_params": {"max_new_tokens": 1000}})
        .json()
    )
    assert 8 <= c["meta_info"]["completion_tokens"] < 1000
    assert c["meta_info"]["finish_reason"]["type"] == "stop"
    # stop strings cut the text before the match
    words = a["text"].split()
    stop = " " + words[3]
    d = (
        client()
        .post(
            u + "/generate",
            json={**body, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "stop": [stop]}},
        )
        .json()
    )
    assert stop not in d["text"] and a["text"].startswith(d["text"])
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # input_ids work too
    e = client().post(
        u + "/generate", json={"input_ids": list(range(1, 40)), "sampling_params": {"max_new_tokens": 3}}
    )
    assert e.json()["meta_info"]["prompt_tokens"] == 39


def test_streaming_endpoints(worker):
    u = worker.url
    g = _sse(
        client().post(
            u + "/generate",
            json={
                "text": _words(30, 2),
                "stream": True,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            },
        )
    )
    assert g[-1] == "[DONE]" and len(g) == 5 + 2
    assert g[-2]["meta_info"]["finish_reason"]["type"] == "length"
    full = (
        client()
        .post(
            u + "/generate",
            json={"text": _words(30, 2), "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}},
        )
        .json()
    )
    assert g[-2]["text"] == full["text"]  # cumulative text, as SGLang streams /generate

    msgs = [{"role": "user", "content": _words(40, 3)}]
    chunks = _sse(
        client().post(
            u + "/v1/chat/completions",
            json={
                "model": "m",
                "messages": msgs,
                "max_tokens": 6,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c.get("choices"))
    assert chunks[-2]["usage"]["completion_tokens"] == 6 and chunks[-2]["choices"] == []
    ns = (
        client()
        .post(
            u + "/v1/chat/completions",
            json={"model": "m", "messages": msgs, "max_tokens": 6, "ignore_eos": True},
        )
        .json()
    )
    assert ns["choices"][0]["message"]["content"] == text
    assert ns["choices"][0]["finish_reason"] == "length"
    assert ns["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same prompt as the stream

    comp = _sse(
        client().post(
            u + "/v1/completions",
            json={"model": "m", "prompt": _words(20, 4), "max_tokens": 4, "stream": True, "ignore_eos": True},
        )
    )
    assert comp[-1] == "[DONE]" and comp[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in comp[:-1] if c["choices"][0]["text"]) == 4
    nc = (
        client()
        .post(u + "/v1/completions", json={"model": "m", "prompt": list(range(5, 60)), "max_tokens": 2})
        .json()
    )
    assert nc["object"] == "text_completion" and nc["usage"]["prompt_tokens"] == 55


def test_kv_events_predict_local_hits_exactly(worker):
    """A subscriber that mirrors BlockStored/BlockRemoved predicts every local hit, through
    evictions (capacity 1024 tokens = 64 pages) and a flush."""
    u = worker.url
    mirror = subscribe_synced(u, worker.kv_events)
    try:
        tok = SimpleTokenizer()
        rng = random.Random(11)
        sessions = [_words(rng.randrange(20, 120), 100 + i) for i in range(6)]
        seen_hits = seen_evictions = 0
        for step in range(40):
            i = rng.randrange(len(sessions))
            sessions[i] += " " + _words(rng.randrange(5, 80), 1000 + step)
            if len(sessions[i]) > 3000:
                sessions[i] = _words(30, 5000 + step)
            tokens = tok.encode(sessions[i])
            hs = page_hashes(tokens, PS)
            predicted = mirror.match_pages(hs, matchable_pages(len(tokens), PS)) * PS
            r = (
                client()
                .post(u + "/generate", json={"text": sessions[i], "sampling_params": {"max_new_tokens": 1}})
                .json()
            )
            meta = r["meta_info"]
            assert meta["cached_tokens_local"] == predicted, (step, meta)
            assert meta["cached_tokens_global"] == 0 and meta["cached_tokens"] == predicted
            seen_hits += predicted > 0
            mirror.sync(server_seq(u))
            info = client().get(u + "/server_info").json()["internal_states"][0]
            assert len(mirror.blocks) == info["cached_pages"]
            seen_evictions = info["cache_stats"]["removed_pages"]
        assert seen_hits >= 10 and seen_evictions > 0 and mirror.gaps == 0
        # flush: AllBlocksCleared, and the next request hits nothing
        assert client().post(u + "/flush_cache").status_code == 200
        mirror.sync(server_seq(u))
        assert mirror.blocks == {} and mirror.events[-1] == {"type": "AllBlocksCleared"}
        r = (
            client()
            .post(u + "/generate", json={"text": sessions[0], "sampling_params": {"max_new_tokens": 1}})
            .json()
        )
        assert r["meta_info"]["cached_tokens"] == 0
        # the events' token ids are the pages' tokens: another hash scheme can be mapped from them
        mirror.sync(server_seq(u))
        toks = tok.encode(sessions[0])
        for k, h in enumerate(page_hashes(toks, PS)):
            assert mirror.blocks[h] == toks[k * PS : (k + 1) * PS]
    finally:
        mirror.close()


def test_timing_follows_the_cost_model(procs):
    """TTFT of a cold prompt ~ cost(L, L) * time_factor; a cached follow-up is much faster;
    chunked prefill: two concurrent prompts share steps."""
    tf = 1.0  # modelled seconds run in real time: the cold prompt takes ~0.6 s
    w = procs.worker("colocated", page_size=64, time_factor=tf, hardware="h20", chunk_tokens=4096)
    hw = load_hardware("h20")
    prompt = list(range(1, 8001))
    t0 = time.monotonic()
    r = (
        client()
        .post(
            w.url + "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}},
            timeout=60,
        )
        .json()
    )
    wall = time.monotonic() - t0
    # two chunks of 4096/3904 tokens, each with its own forward overhead
    expect = (hw.cost.chunk(4096, 4096) + hw.cost.chunk(3904, 8000) + 2 * hw.cost.c_fwd) * tf
    assert r["meta_info"]["ttft"] >= 0.95 * expect
    assert wall < expect + 1.0
    r2 = (
        client()
        .post(
            w.url + "/generate",
            json={"input_ids": prompt + list(range(9000, 9100)), "sampling_params": {"max_new_tokens": 1}},
            timeout=60,
        )
        .json()
    )
    assert r2["meta_info"]["cached_tokens_local"] == 8000 - 8000 % 64
    assert r2["meta_info"]["ttft"] < 0.25 * r["meta_info"]["ttft"]


def test_abort_request(procs):
    w = procs.worker("colocated", page_size=64, time_factor=1.0)  # a 60k-token prompt: ~20 s modelled
    import threading

    out = {}

    def send():
        out["r"] = (
            client()
            .post(
                w.url + "/generate",
                json={
                    "input_ids": list(range(1, 60000)),
                    "rid": "victim",
                    "sampling_params": {"max_new_tokens": 4},
                },
                timeout=60,
            )
            .json()
        )

    t = threading.Thread(target=send)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if client().get(w.url + "/v1/loads").json()["loads"][0]["num_running_reqs"]:
            break
        time.sleep(0.05)
    assert client().post(w.url + "/abort_request", json={"rid": "victim"}).json()["aborted"] == 1
    t.join(10)
    assert out["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert client().get(w.url + "/health").status_code == 200


def test_pd_hand_off_over_http_without_mooncake(procs):
    """The fallback hand-off (no TransferEngine, e.g. a laptop without Mooncake): the decode
    half still receives exactly the prefill's bytes."""
    import threading

    p = procs.worker("prefill", page_size=PS, time_factor=0.001, kv_transport="http")
    d = procs.worker("decode", page_size=PS, time_factor=0.001, kv_transport="http")
    toks = list(range(1, 20 * PS + 3))
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 12345}
    body = {"input_ids": toks, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}, **boot}
    out = {}
    t = threading.Thread(target=lambda: out.update(d=client().post(d.url + "/generate", json=body).json()))
    t.start()
    out["p"] = client().post(p.url + "/generate", json=body).json()
    t.join(30)
    ed, ep = out["d"]["meta_info"]["emulator"], out["p"]["meta_info"]["emulator"]
    assert ep["transport"] == ed["transport"] == "http"
    assert ed["kv_verified"] is True and ed["kv_received_digest"] == ep["kv_digest"]
    assert "kv_b64" not in ed and "kv_b64" not in ep
    assert out["d"]["meta_info"]["completion_tokens"] == 3


def test_chunked_prefill_shares_steps_fcfs(procs):
    """A long prompt is prefilled in chunks of ``chunk_tokens``; a short one arriving meanwhile
    joins the step where the long one's last chunk leaves room (SGLang's FCFS chunked prefill),
    so both finish together, after the long one's modelled time."""
    import threading

    tf = 0.5
    w = procs.worker("colocated", page_size=64, time_factor=tf, hardware="h20", chunk_tokens=4096)
    cm = load_hardware("h20").cost
    done: dict = {}

    def send(key, toks):
        r = client().post(
            w.url + "/generate", json={"input_ids": toks, "sampling_params": {"max_new_tokens": 1}}
        )
        done[key] = (time.monotonic(), r.json()["meta_info"])

    a = threading.Thread(target=send, args=("a", list(range(1, 12001))))
    b = threading.Thread(target=send, args=("b", list(range(20000, 21000))))
    a.start()
    time.sleep(0.05)
    b.start()
    a.join(30)
    b.join(30)
    steps = [
        cm.chunk(4096, 4096),
        cm.chunk(4096, 8192),
        cm.chunk(3808, 12000) + cm.chunk(288, 288),
    ]
    a_model = (sum(steps) + 3 * cm.c_fwd) * tf
    assert done["a"][1]["ttft"] >= 0.95 * a_model
    # b was admitted only when a's last chunk left room in the budget: it ends just after a
    assert done["b"][0] >= done["a"][0] - 0.01
    assert done["b"][1]["ttft"] >= 0.8 * (a_model - 0.05)
    assert done["b"][1]["emulator"]["queue_s"] > 0.3 * a_model  # it waited for admission


def test_debug_fault_endpoint_only_when_asked_for():
    from stack.worker.server import FaultInjector, with_faults
    from stack.worker.settings import WorkerSettings

    app = object()
    assert with_faults(app, WorkerSettings()) is app  # no unauthenticated /debug/fault by default
    assert isinstance(with_faults(app, WorkerSettings(fault_control=True)), FaultInjector)
    assert isinstance(with_faults(app, WorkerSettings(fault="slow")), FaultInjector)


def test_failed_hand_off_is_answered_as_sglang_does(procs):
    """A decode half whose prefill twin never sends the KV gives up after its bootstrap timeout
    and answers as SGLang 0.5.23 does (an abort with status 500): a stream gets an OpenAI error
    event then ``[DONE]``, a collected answer a 500 error body, ``/generate`` an abort whose
    ``finish_reason`` carries the status code; never an empty success."""
    d = procs.worker("decode", page_size=PS, time_factor=0.001, kv_transport="http", bootstrap_timeout_s=0.5)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 777}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **boot}
    c = client()
    r = c.post(d.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 500 and r.json()["code"] == 500 and r.json()["message"]
    r = c.post(d.url + "/v1/chat/completions", json=dict(chat, stream=True, bootstrap_room=778))
    assert r.status_code == 200
    events = _sse(r)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"]["code"] == 500 and events[0]["error"]["type"] == "INTERNAL_SERVER_ERROR"
    gen = {
        "input_ids": list(range(1, 40)),
        "sampling_params": {"max_new_tokens": 3},
        **boot,
        "bootstrap_room": 779,
    }
    events = _sse(c.post(d.url + "/generate", json=dict(gen, stream=True)))
    fr = events[0]["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 500 and events[0]["text"] == ""
