"""The router's dispatch queue live against emulated PD workers on loopback: a prefill
worker dies while requests wait in the router's queue, and every request still gets
exactly one answer (200, or an explicit 503 / 529 overload answer), none is lost, none is
served twice."""

from __future__ import annotations

import asyncio
import collections

import httpx
import orjson
import pytest

from stack.models.tiny import build_tiny_model
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _marker(req: dict) -> str | None:
    """The request's own marker in what a fake worker received."""
    s = orjson.dumps(req).decode()
    i = s.find("req-")
    return s[i : s.find("-end", i)] if i >= 0 else None


def _body(i: int, anthropic: bool) -> tuple[str, dict]:
    text = f"req-{i}-end please answer"
    if anthropic:
        return "/v1/messages", {
            "model": "tiny",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
        }
    return "/v1/chat/completions", {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
    }


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "max_queue"])
def test_worker_dies_while_requests_wait(model_dir, bounded):
    n = 30
    dispatch = {"order": "deadline", "readiness": {"max_running": 1, "max_queued_s": 0.5}}
    if bounded:
        dispatch["max_queue"] = 8
        dispatch["max_queue_wait_s"] = 20.0
    c = Cluster(
        model_dir,
        n_prefill=3,
        n_decode=1,
        router={"dispatch": dispatch, "retry_after_s": 2},
        prefill_kw={"prefill_delay_s": 0.15},
    )
    try:
        q = c.state.queue
        assert not q.immediate
        dead_url = c.servers[0].url

        async def go():
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as cl:

                async def one(i: int):
                    path, body = _body(i, anthropic=bounded and i % 2 == 1)
                    r = await cl.post(path, json=body)
                    return i, path, r

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                # kill a prefill worker once requests wait in the router's queue
                for _ in range(400):
                    if q.depth >= 4:
                        break
                    await asyncio.sleep(0.005)
                depth_at_kill = q.depth
                await asyncio.to_thread(c.servers[0].stop)
                done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return depth_at_kill, done

        depth_at_kill, done = asyncio.run(go())
        assert depth_at_kill >= 4, "requests did not queue at the router"
        # the fake workers serve no /v1/messages: an Anthropic request that reached one is
        # answered with the worker's 404 (passed through), which is its one answer here
        forwarded = {i for i, p, r in done if p == "/v1/messages" and r.status_code == 404}
        statuses = collections.Counter(r.status_code for i, _, r in done if i not in forwarded)
        served = {i for i, _, r in done if r.status_code == 200}
        refused = {i for i, _, r in done if r.status_code not in (200, 404)}
        assert len(done) == n and len(served) + len(refused) + len(forwarded) == n  # one answer each
        for i, path, r in done:
            if r.status_code == 200 or i in forwarded:
                continue
            assert r.headers.get("retry-after") == "2", (i, r.status_code, r.text)
            if path == "/v1/messages":
                assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
            else:
                assert r.status_code == 503 and r.json()["error"]["code"] in ("overloaded", "no_worker")
        if not bounded:
            assert statuses == {200: n}  # survivors served everything
        else:
            assert len(served) + len(forwarded) >= 8 and len(refused) >= 1, statuses  # the bound refused some
            assert any(done[i][1] == "/v1/messages" for i in refused), "no Anthropic request was refused"
        # the emulated workers: a served request reached the surviving prefill workers at
        # most once and the decode worker; a refused one reached no worker at all
        seen_p = collections.Counter()
        seen_dead = collections.Counter()
        for s, w in zip(c.servers, c.prefill + c.decode, strict=True):
            if w.mode == "decode":
                continue
            for _, req, _ in w.records:
                (seen_dead if s.url == dead_url else seen_p)[_marker(req)] += 1
        seen_d = collections.Counter(_marker(req) for _, req, _ in c.decode[0].records)
        for i in served:
            m = f"req-{i}"
            assert seen_p[m] <= 1, (m, seen_p[m])
            assert seen_p[m] + seen_dead[m] >= 1 and seen_d[m] >= 1, m
        for i in refused:
            m = f"req-{i}"
            assert seen_p[m] == seen_dead[m] == seen_d[m] == 0, m
        # the queue is empty and nothing holds the gate; its metrics add up
        assert q.depth == 0 and q.gate == 0
        text = c.client.get("/metrics").text
        samples = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith("smetric_dispatch_")
        }
        assert samples["smetric_dispatch_queue_depth"] == 0
        rejected = sum(v for k, v in samples.items() if k.startswith("smetric_dispatch_rejected_total"))
        no_worker = sum(
            1 for _, _, r in done if r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        )
        assert rejected + no_worker == len(refused)
        assert samples["smetric_dispatch_queue_wait_seconds_count"] == n - rejected
        assert c.client.get("/metrics").text.count("smetric_dispatch_deferrals_total") >= 1
    finally:
        c.close()


def test_a_client_that_leaves_while_waiting_gives_up_its_place(model_dir):
    """A client that disconnects while its request waits in the router's queue is taken out
    of the queue (counted as cancelled) and never reaches a worker."""
    dispatch = {"order": "deadline", "readiness": {"max_running": 1, "max_queued_s": 0.5}}
    slow = {"prefill_delay_s": 1.5}  # the fake decode answers after its delay too
    c = Cluster(
        model_dir, n_prefill=1, n_decode=1, router={"dispatch": dispatch}, prefill_kw=slow, decode_kw=slow
    )
    try:
        q = c.state.queue

        async def go():
            async with httpx.AsyncClient(base_url=c.url, timeout=60) as cl:
                first = asyncio.create_task(cl.post("/v1/chat/completions", json=_body(0, False)[1]))
                for _ in range(400):  # the first one holds the only prefill worker
                    if c.prefill[0].records:
                        break
                    await asyncio.sleep(0.005)
                async with httpx.AsyncClient(base_url=c.url, timeout=0.5) as short:
                    with pytest.raises(httpx.ReadTimeout):
                        await short.post("/v1/chat/completions", json=_body(1, False)[1])
                for _ in range(400):
                    if q.depth == 0:
                        break
                    await asyncio.sleep(0.01)
                return q.depth, await first

        depth, first = asyncio.run(go())
        assert first.status_code == 200
        assert depth == 0, "the abandoned request still waits in the queue"
        assert q.metrics.cancelled._value.get() == 1
        assert not any(_marker(req) == "req-1" for w in c.prefill + c.decode for _, req, _ in w.records)
    finally:
        c.close()
