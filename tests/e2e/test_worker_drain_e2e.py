"""A worker drain on the emulated stack (`smetric up`: the router in front of emulated SGLang
workers, which speak SGLang's HTTP and PD protocol): a prefill worker drained while a long
prompt is in its prefill answers that request, leaves the pool, and serves again once added
back; the other worker takes the traffic meanwhile."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

TOKEN = "e2e-drain-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def stack_info(tmp_path_factory):
    from stack.replay.localstack import local_stack

    old = os.environ.get("SMETRIC_ADMIN_TOKEN")
    os.environ["SMETRIC_ADMIN_TOKEN"] = TOKEN  # the router reads it at start
    try:
        with local_stack(
            prefill=2,
            decode=1,
            ports="auto",
            time_factor=1.0,
            mooncake=False,
            run_dir=tmp_path_factory.mktemp("run"),
        ) as info:
            yield info
    finally:
        if old is None:
            os.environ.pop("SMETRIC_ADMIN_TOKEN", None)
        else:
            os.environ["SMETRIC_ADMIN_TOKEN"] = old


def _workers(c: httpx.Client) -> list[dict]:
    r = c.get("/admin/workers", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["workers"]


MODEL: list[str] = []  # the model the stack serves (the first of /v1/models)


def _chat(text: str, max_tokens: int = 4) -> dict:
    return {"model": MODEL[0], "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def test_a_drained_emulated_worker_answers_what_it_holds_then_leaves(stack_info):
    with httpx.Client(base_url=stack_info["router_url"], timeout=60) as c:
        MODEL[:] = [c.get("/v1/models").json()["data"][0]["id"]]
        held: dict = {}
        long = _chat(" ".join(f"w{i}" for i in range(6_000)))  # a prefill of about a second
        t = threading.Thread(target=lambda: held.update(r=c.post("/v1/chat/completions", json=long)))
        t.start()
        busy, deadline = None, time.monotonic() + 30
        while busy is None:
            assert time.monotonic() < deadline, f"no prefill in flight: {held}"
            b = [w for w in _workers(c) if w["role"] == "prefill" and w["queued_tokens"] > 0]
            busy = b[0] if b else time.sleep(0.02)
        r = c.post("/admin/workers/drain", json={"url": busy["url"], "role": "prefill"}, headers=AUTH)
        assert r.status_code == 202 and r.json()["draining"]["draining"] is True
        t.join(60)
        assert held["r"].status_code == 200 and held["r"].json()["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 10
        while any(w["url"] == busy["url"] for w in _workers(c)):
            assert time.monotonic() < deadline, "the drained worker never left the pool"
            time.sleep(0.05)
        other = next(w for w in _workers(c) if w["role"] == "prefill")
        for i in range(3):
            assert c.post("/v1/chat/completions", json=_chat(f"after the drain {i}")).status_code == 200
        after = next(w for w in _workers(c) if w["url"] == other["url"])
        assert after["dispatched"] == other["dispatched"] + 3
        back = {k: busy[k] for k in ("url", "bootstrap_port", "kv_events", "kv_replay") if busy.get(k)}
        r = c.post("/admin/workers", json={"role": "prefill", **back}, headers=AUTH)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 20
        while True:
            w = next((w for w in _workers(c) if w["url"] == busy["url"]), None)
            if w is not None and w["healthy"]:
                break
            assert time.monotonic() < deadline, "the worker added back is not healthy"
            time.sleep(0.1)
        # it serves again: concurrent first turns spread over both workers
        with ThreadPoolExecutor(6) as ex:
            bodies = [_chat(" ".join(f"b{i}x{j}" for j in range(2000))) for i in range(6)]
            codes = list(ex.map(lambda b: c.post("/v1/chat/completions", json=b).status_code, bodies))
        assert codes == [200] * 6
        assert next(w for w in _workers(c) if w["url"] == busy["url"])["dispatched"] > 0
