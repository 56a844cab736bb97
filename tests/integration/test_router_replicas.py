"""Router replicas sharing dispatch accounting and the worker registry through a real Redis:
no double-booking of an idle worker, registry changes propagate, a dead replica's figures
expire with its heartbeat, and Redis stopped and restarted under load loses no request."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from stack.config import parse_config
from stack.models.tiny import build_tiny_model
from stack.pool import WorkerRegistry
from stack.ports import free_port
from stack.prefill_router.shared_state import SharedState
from stack.worker.fake import FakeWorker, ServerThread

pytestmark = pytest.mark.timeout(60)

ADMIN_ENV = "SMETRIC_TEST_REPLICA_TOKEN"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


class Replicas:
    """Fake prefill/decode workers and ``n`` router replicas (in-process, each on its own
    uvicorn thread) over them; ``redis_url`` None: independent routers (no shared state)."""

    def __init__(self, model_dir, redis_url, n=2, n_prefill=2, prefill_delay_s=0.0, router=None):
        self.prefill = [
            FakeWorker(mode="prefill", name=f"p{i}", prefill_delay_s=prefill_delay_s)
            for i in range(n_prefill)
        ]
        # decode answers after the prefill time too (it waits for the KV), so a request holds
        # its prefill worker (in the routers' accounting) for prefill_delay_s
        self.decode = [FakeWorker(mode="decode", name="d0", tokens=2, prefill_delay_s=prefill_delay_s)]
        self.servers = [ServerThread(w).start() for w in self.prefill + self.decode]
        self.apps, self.routers = [], []
        for i in range(n):
            self.add_router(model_dir, redis_url, f"r{i}", router)
        self.clients = [httpx.Client(base_url=r.url, timeout=30) for r in self.routers]

    def add_router(self, model_dir, redis_url, rid, router=None):
        from stack.prefill_router.service import create_app

        rc = {
            "policy": "smetric",
            "health_interval_s": 0.5,
            "load_poll": False,  # shared state only: no help from the workers' own counts
            "admin_token_env": ADMIN_ENV,
            "redis_url": redis_url,
            "replica_id": rid,
            "redis_heartbeat_s": 0.2,
            "redis_ttl_s": 1.0,
            "log_level": "warning",
        }
        rc.update(router or {})
        n_p = len(self.prefill)
        cfg = parse_config(
            {
                "model": {"name": "tiny", "path": str(model_dir), "page_size": 16, "context_length": 8192},
                "router": rc,
                "prefill": [
                    {"url": s.url, "bootstrap_port": 9000 + i} for i, s in enumerate(self.servers[:n_p])
                ],
                "decode": [{"url": s.url} for s in self.servers[n_p:]],
            }
        )
        app = create_app(cfg)
        self.apps.append(app)
        self.routers.append(ServerThread(app).start())

    def state(self, i):
        return self.apps[i].state.router

    def close(self):
        for c in self.clients:
            c.close()
        for r in self.routers:
            r.stop()
        for s in self.servers:
            s.stop()


def _first_turn(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"session {i} " + "lorem ipsum dolor " * (20 + i)}]}


def _wait(cond, timeout=10.0, step=0.02):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met"
        time.sleep(step)


def _wait_settled(redis_server, timeout=5.0):
    """Until every replica's published figures are back to zero (all answers ended)."""
    r = redis_server.client()
    _wait(lambda: all(v.decode().split()[1:4] == ["0", "0.0", "0"] for v in r.hvals("smetric:acct")), timeout)


def _prefill_counts(rep: Replicas) -> list[int]:
    return [sum(1 for p, _, _ in w.records if p != "/health") for w in rep.prefill]


def _simultaneous(rep: Replicas, n_req: int, only: int | None = None, base: int = 0) -> None:
    """n_req new first turns at the same instant, spread round-robin over the replicas."""
    barrier = threading.Barrier(n_req)

    def go(i):
        barrier.wait()
        c = rep.clients[i % len(rep.clients) if only is None else only]
        return c.post("/v1/chat/completions", json=_first_turn(base + i))

    with ThreadPoolExecutor(n_req) as ex:
        rs = list(ex.map(go, range(n_req)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]


def test_no_double_booking_of_idle_workers(model_dir, redis_server):
    # 2 replicas, 4 idle workers, 4 simultaneous first turns (2 per replica): one per worker,
    # three rounds in a row (each round's requests still hold their worker when it starts)
    rep = Replicas(model_dir, redis_server.url, n=2, n_prefill=4, prefill_delay_s=0.6)
    try:
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)))
        for rnd in range(1, 3):
            _wait_settled(redis_server)  # completions are published within redis_flush_s
            _simultaneous(rep, 4, base=10 * rnd)
            assert _prefill_counts(rep) == [rnd] * 4
        # concurrent requests on one replica see each other's claims in flight
        _wait_settled(redis_server)
        _simultaneous(rep, 4, only=0, base=50)
        assert _prefill_counts(rep) == [3] * 4
        st = [rep.state(i).shared.conn.stats for i in range(2)]
        assert sum(s["claims"] for s in st) >= 8
    finally:
        rep.close()


def test_without_redis_replicas_double_book(model_dir):
    # the control: two independent routers both pick the same idle worker
    rep = Replicas(model_dir, None, n=2, n_prefill=2, prefill_delay_s=0.3)
    try:
        _simultaneous(rep, 2)
        assert sorted(_prefill_counts(rep)) == [0, 2]
        assert "shared_state" not in rep.clients[0].get("/health").json()
    finally:
        rep.close()


def test_registry_changes_propagate(model_dir, redis_server, monkeypatch):
    monkeypatch.setenv(ADMIN_ENV, "tok")
    extra = ServerThread(FakeWorker(mode="prefill", name="px")).start()
    rep = Replicas(model_dir, redis_server.url, n=2, n_prefill=1)
    try:
        auth = {"authorization": "Bearer tok"}
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)))
        r = rep.clients[0].post(
            "/admin/workers", json={"url": extra.url, "bootstrap_port": 9009}, headers=auth
        )
        assert r.status_code == 201
        other = rep.state(1).registry
        _wait(lambda: other.find("prefill", extra.url) is not None, timeout=5)
        assert other.find("prefill", extra.url).bootstrap_port == 9009
        redis_server.client().hset("smetric:ver", f"prefill|{extra.url}", 3)  # as after 3 bookings
        r = rep.clients[1].request("DELETE", "/admin/workers", json={"url": extra.url}, headers=auth)
        assert r.status_code == 200
        _wait(lambda: rep.state(0).registry.find("prefill", extra.url) is None, timeout=5)
        # the removed worker's booking version goes with it (every read returns that hash)
        assert f"prefill|{extra.url}".encode() not in redis_server.client().hkeys("smetric:ver")
        # a replica started later adopts the shared registry (and adds its configured workers)
        r = rep.clients[0].post("/admin/workers", json={"url": extra.url}, headers=auth)
        assert r.status_code == 201
        rep.add_router(model_dir, redis_server.url, "r2")
        late = rep.state(2)
        _wait(lambda: late.shared.up and late.registry.find("prefill", extra.url) is not None, timeout=5)
    finally:
        rep.close()
        extra.stop()


def test_a_worker_drain_reaches_every_replica(model_dir, redis_server, monkeypatch):
    """A drain started on one replica: the other stops routing to the worker too (the deadline
    travels in the shared registry), a request held by the other replica keeps the worker in
    the pool until it ends, and then it leaves both."""
    monkeypatch.setenv(ADMIN_ENV, "tok")
    rep = Replicas(model_dir, redis_server.url, n=2, n_prefill=2, prefill_delay_s=1.0)
    try:
        auth = {"authorization": "Bearer tok"}
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)))
        held = []
        t = threading.Thread(
            target=lambda: held.append(rep.clients[1].post("/v1/chat/completions", json=_first_turn(0)))
        )
        t.start()
        _wait(lambda: any(w.active for w in rep.prefill))
        busy = next(i for i, w in enumerate(rep.prefill) if w.active)
        url = rep.servers[busy].url
        r = rep.clients[0].post("/admin/workers/drain", json={"url": url, "role": "prefill"}, headers=auth)
        assert r.status_code == 202
        w1 = rep.state(1).registry.find("prefill", url)
        _wait(lambda: w1.draining_until is not None, timeout=5)  # replica 1 learned of it
        # replica 0 sees replica 1's request on the worker: it stays in both pools meanwhile
        assert rep.state(0).registry.find("prefill", url) is not None
        n = _prefill_counts(rep)[busy]
        _simultaneous(rep, 4, base=10)  # new requests, both replicas: none to the drained worker
        assert _prefill_counts(rep)[busy] == n
        t.join(20)
        assert held[0].status_code == 200
        for i in range(2):
            _wait(lambda i=i: rep.state(i).registry.find("prefill", url) is None, timeout=5)
    finally:
        rep.close()


def test_heartbeat_expiry_drops_contributions(redis_server):
    async def main():
        ra, rb = WorkerRegistry(), WorkerRegistry()
        for reg in (ra, rb):
            reg.add("prefill", "http://w0:1")
            reg.add("prefill", "http://w1:1")
        kw = dict(namespace="t", heartbeat_s=0.1, ttl_s=0.5, flush_s=0.02)
        a = SharedState(redis_server.url, ra, replica_id="a", **kw)
        b = SharedState(redis_server.url, rb, replica_id="b", **kw)
        await a.start()
        await b.start()
        assert a.up and b.up
        wa = ra.find("prefill", "http://w1:1")
        ra.charge(wa, 1000, 0.5)
        ra.charge(wa, 500, 0.25)
        await asyncio.sleep(0.1)  # the flusher publishes
        snap = await b.conn.refresh()
        wb = rb.find("prefill", "http://w1:1")
        assert snap.others["prefill|http://w1:1"] == (1500, 0.75, 2)
        assert (wb.shared_tokens, wb.shared_running) == (1500, 2)
        assert wb.view_queued(10, time.monotonic(), 1e-4) == (1500, 0.75)
        assert wb.view_running(10, time.monotonic()) == 2
        # a stale booking version makes a claim fail and hands back the fresh figures
        stale = await b.conn.refresh()
        assert await a.bookings.claim(wa, 10, 0.01, await a.conn.refresh()) is None
        fresh = await b.bookings.claim(wb, 10, 0.01, stale)
        assert fresh is not None and fresh.others["prefill|http://w1:1"][2] == 3
        # past the request's Redis deadline a stale claim books anyway (no more round trips)
        assert await b.bookings.claim(wb, 10, 0.01, stale, deadline=time.monotonic() - 1) is None
        # replica a stops beating (a crash: no clean exit): its figures vanish after the TTL
        for t in a._tasks:
            t.cancel()
        await asyncio.sleep(0.8)
        snap = await b.conn.refresh()
        assert "prefill|http://w1:1" not in snap.others and wb.shared_running == 0
        await asyncio.sleep(0.2)  # b's heartbeat garbage-collects a's fields
        r = redis_server.client()
        assert not [f for f in r.hkeys("t:acct") if f.startswith(b"a\t")]
        assert r.smembers("t:replicas") == {b"b"}
        await b.stop()
        a.conn.up = False
        await a.stop()

    asyncio.run(main())


def test_replicas_see_each_others_link_backlogs(redis_server):
    """A fetch one replica books on a worker's link is queued on the other replica's FIFO of
    that link (and of the workers sharing it with ``router.link: host``), in each one's pool
    seconds, behind its own: one link drains the fetches of both at its own rate. A
    replica's death does not undo what its fetches still hold of the link."""

    async def main():
        tf = 2.0  # wall seconds per pool second: the pool's clocks differ from the wall's
        regs = [WorkerRegistry(link="host"), WorkerRegistry(link="host")]
        for reg in regs:
            reg.add("prefill", "http://10.0.0.1:1")  # two workers on one host: one link
            reg.add("prefill", "http://10.0.0.1:2")
            reg.add("prefill", "http://10.0.0.2:1")  # another host
        kw = dict(namespace="lk", heartbeat_s=0.1, ttl_s=0.5, flush_s=0.02, time_factor=tf)
        a = SharedState(redis_server.url, regs[0], replica_id="a", **kw)
        b = SharedState(redis_server.url, regs[1], replica_id="b", **kw)
        await a.start()
        await b.start()
        assert a.up and b.up

        def pool_now() -> float:
            return time.monotonic() / tf

        urls = ("http://10.0.0.1:1", "http://10.0.0.1:2", "http://10.0.0.2:1")
        wa = regs[0].find("prefill", urls[0])
        b1, b2, b_other = (regs[1].find("prefill", u) for u in urls)
        wa.fetch_booked(pool_now(), 3.0)  # 3 pool seconds = 6 wall seconds
        regs[0].charge(wa, 100, 0.01)
        await asyncio.sleep(0.1)  # a's flusher publishes
        snap = await b.conn.refresh()
        assert snap.links[f"prefill|{urls[0]}"] == pytest.approx(6.0)  # wall seconds, counted
        assert snap.others[f"prefill|{urls[0]}"] == (100, 0.01, 1)
        # b's view of that host's link carries a's fetch, in b's pool seconds; b booked none
        for w in (b1, b2):
            assert 2.8 < w.link_backlog(pool_now()) <= 3.0
        assert b1.link.booked == 0.0
        assert b_other.link_backlog(pool_now()) == 0.0  # another host's link
        # a second read learns nothing twice
        before = b1.link_backlog(pool_now())
        await b.conn.refresh()
        assert b1.link_backlog(pool_now()) <= before
        # b's own fetch queues behind it: the link is through when both are
        b2.fetch_booked(pool_now(), 1.0)
        assert 3.8 < b1.link_backlog(pool_now()) <= 4.0
        assert b1.link.booked == 1.0
        regs[1].charge(b2, 100, 0.01)
        await asyncio.sleep(0.1)
        await a.conn.refresh()  # and a learns b's
        assert 3.7 < wa.link_backlog(pool_now()) <= 4.0
        # one link drains at one rate: 0.4 wall seconds are 0.2 pool seconds off the whole
        t0, left0 = pool_now(), b1.link_backlog(pool_now())
        await asyncio.sleep(0.4)
        await b.conn.refresh()
        assert b1.link_backlog(pool_now()) == pytest.approx(left0 - (pool_now() - t0), abs=0.03)
        # a crashes (no clean exit): its counters leave the shared state with its heartbeat,
        # but the fetch it booked still holds the link (the workers fetch, not the router)
        for t in a._tasks:
            t.cancel()
        await asyncio.sleep(0.8)
        snap = await b.conn.refresh()
        assert f"prefill|{urls[0]}" not in snap.links
        t1, left1 = pool_now(), b1.link_backlog(pool_now())
        assert left1 > 2.5
        # a replica that comes back under that id starts its counters at 0: only what it
        # books from then on is new to b
        regs[0] = WorkerRegistry(link="host")
        for u in urls:
            regs[0].add("prefill", u)
        a2 = SharedState(redis_server.url, regs[0], replica_id="a", **kw)
        await a2.start()
        await b.conn.refresh()  # its counters: 0 yet, as it started them
        regs[0].find("prefill", urls[1]).fetch_booked(pool_now(), 0.5)
        regs[0].charge(regs[0].find("prefill", urls[1]), 10, 0.01)
        await asyncio.sleep(0.1)
        await b.conn.refresh()
        expect = left1 - (pool_now() - t1) + 0.5
        assert b1.link_backlog(pool_now()) == pytest.approx(expect, abs=0.03)
        await b.stop()
        await a2.stop()
        a.conn.up = False
        await a.stop()

    asyncio.run(main())


def test_redis_unreachable_at_start_serves_locally(model_dir):
    rep = Replicas(model_dir, f"redis://127.0.0.1:{free_port()}/0", n=1, n_prefill=2)
    try:
        r = rep.clients[0].post("/v1/chat/completions", json=_first_turn(0))
        assert r.status_code == 200
        h = rep.clients[0].get("/health").json()
        assert h["status"] == "ok" and h["shared_state"] == "down"
        assert "smetric_shared_state_up 0.0" in rep.clients[0].get("/metrics").text
    finally:
        rep.close()


@pytest.mark.faults
def test_redis_stopped_and_restarted_under_load(model_dir, redis_server):
    """Redis killed mid-run and restarted empty: requests keep succeeding on local state,
    lost = 0, and both replicas resync (heartbeats, registry, figures back in Redis)."""
    rep = Replicas(model_dir, redis_server.url, n=2, n_prefill=3, prefill_delay_s=0.02)
    counts = {"sent": 0, "ok": 0, "clean_error": 0, "lost": 0}
    lost_examples = []
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop(k):
        i = k
        while not stop.is_set():
            i += 4
            c = rep.clients[i % 2]
            with lock:
                counts["sent"] += 1
            try:
                r = c.post("/v1/chat/completions", json=_first_turn(i % 50), timeout=10)
            except httpx.HTTPError as e:
                with lock:
                    counts["lost"] += 1
                    lost_examples.append(repr(e))
                continue
            body = r.json()
            with lock:
                if r.status_code == 200 and body["usage"]["completion_tokens"] == 2:
                    counts["ok"] += 1
                elif r.status_code in (429, 502, 503) and {"message", "code"} <= set(body.get("error", {})):
                    counts["clean_error"] += 1
                else:
                    counts["lost"] += 1
                    lost_examples.append(f"{r.status_code} {r.text[:200]}")

    try:
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)))
        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        redis_server.stop()
        _wait(lambda: not any(rep.state(i).shared.up for i in range(2)), timeout=5)
        down_ok = counts["ok"]
        time.sleep(1.0)
        assert counts["ok"] > down_ok, "no request succeeded while Redis was down"
        assert all(rep.clients[i].get("/health").json()["shared_state"] == "down" for i in range(2))
        redis_server.start()
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)), timeout=5)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=15)
        print("redis stop/restart:", counts)
        assert counts["lost"] == 0, lost_examples[:5]
        assert counts["ok"] + counts["clean_error"] == counts["sent"]
        assert counts["clean_error"] == 0
        # resync is visible in Redis: both heartbeats, the registry, every replica's figures
        r = redis_server.client()
        assert r.smembers("smetric:replicas") == {b"r0", b"r1"}
        assert r.exists("smetric:hb:r0") and r.exists("smetric:hb:r1")
        assert len(r.hgetall("smetric:workers")) == 4  # 3 prefill + 1 decode
        fields = {f.decode().split("\t")[0] for f in r.hkeys("smetric:acct")}
        assert fields == {"r0", "r1"}
        _wait_settled(redis_server)  # and the figures settle back to zero once idle
        assert all(rep.state(i).shared.conn.stats["resyncs"] >= 2 for i in range(2))
        assert orjson.loads(rep.clients[0].get("/health").content)["shared_state"] == "up"
    finally:
        stop.set()
        rep.close()


@pytest.mark.faults
def test_redis_hung_never_blocks_requests(model_dir, redis_server):
    """Redis frozen (SIGSTOP: connections open, no answers): a request waits at most about
    one Redis timeout while the failure is detected, then routing runs on local state; after
    SIGCONT both replicas resync."""
    rep = Replicas(model_dir, redis_server.url, n=2, n_prefill=2, router={"redis_timeout_s": 0.1})
    try:
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)))
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            lat = []
            for i in range(16):
                t0 = time.monotonic()
                r = rep.clients[i % 2].post("/v1/chat/completions", json=_first_turn(100 + i), timeout=10)
                lat.append(time.monotonic() - t0)
                assert r.status_code == 200, r.text
            assert not any(rep.state(i).shared.up for i in range(2))
            assert max(lat) < 1.5, lat  # the first ones wait out the Redis timeout (0.1-0.25 s)
            assert sorted(lat)[len(lat) // 2] < 0.3, lat
            assert rep.clients[0].get("/health").json()["shared_state"] == "down"
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        _wait(lambda: all(rep.state(i).shared.up for i in range(2)), timeout=10)
        assert rep.clients[1].post("/v1/chat/completions", json=_first_turn(200)).status_code == 200
    finally:
        rep.close()


def test_redis_config_validation():
    assert parse_config({}).router.redis_url is None  # no Redis: a single router, as before
    rc = parse_config({"router": {"redis_url": "redis://10.0.0.1:6379/0", "redis_ttl_s": 3}}).router
    assert rc.redis_url.startswith("redis://") and rc.redis_namespace == "smetric" and rc.redis_ttl_s == 3
    with pytest.raises(ValueError, match="router.redis_url"):
        parse_config({"router": {"redis_url": "10.0.0.1:6379"}})
    with pytest.raises(ValueError, match="router.redis_timeout_s"):
        parse_config({"router": {"redis_timeout_s": 0}})
    with pytest.raises(ValueError, match="redis_ttl_s"):
        parse_config({"router": {"redis_heartbeat_s": 1.0, "redis_ttl_s": 2.0}})


def test_duplicate_replica_id_is_reported(redis_server, caplog):
    async def main():
        kw = dict(namespace="dup", replica_id="same", heartbeat_s=0.05, ttl_s=1.0)
        a = SharedState(redis_server.url, WorkerRegistry(), **kw)
        b = SharedState(redis_server.url, WorkerRegistry(), **kw)
        await a.start()
        await b.start()
        await asyncio.sleep(0.3)
        await a.stop()
        await b.stop()

    with caplog.at_level("WARNING", logger="stack.router.shared"):
        asyncio.run(main())
    assert "another router beats under replica id 'same'" in caplog.text


def test_replicas_share_token_ids_of_a_session(model_dir, redis_server):
    """A session's turns alternating over two replicas (a round-robin balancer): each turn's
    history that the other replica tokenized comes from Redis, counted in /metrics."""
    import random

    rng = random.Random(5)
    words = "alpha beta gamma delta tool call result file path error".split()
    # features in the feature pool (the threads that look up), whatever the body's size
    rep = Replicas(
        model_dir, redis_server.url, router={"feature_inline_bytes": 0, "feature_attempt_bytes": 0}
    )
    try:
        msgs = [{"role": "system", "content": "You are a coding agent. " * 50}]
        for t in range(4):
            msgs = msgs + [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(300))}]
            r = rep.clients[t % 2].post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
            assert r.status_code == 200, r.text
            msgs = msgs + [{"role": "assistant", "content": "done " * 10}]
            rep.state(t % 2).features.tok.shared.flush()

        def hits(i: int) -> float:
            text = rep.clients[i].get("/metrics").text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith('smetric_shared_token_segments_total{outcome="hit"}')
            )

        assert hits(1) >= 1 and hits(0) >= 1  # each fetched what the other tokenized
    finally:
        rep.close()
