"""Two router replicas (processes) sharing one dispatch order through a real Redis
(``router.dispatch.replica_mode: claims``, the default with ``router.redis_url``): both
publish the rank of their next release, and killing one replica (SIGKILL, no clean exit)
loses none of the survivor's requests, while the dead one's ranks, figures and heartbeat
leave the shared state once its heartbeat expires."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from stack.config import parse_config
from stack.models.tiny import build_tiny_model
from stack.pool import WorkerRegistry
from stack.ports import free_port
from stack.prefill_router.shared_state import SharedState
from stack.worker.fake import FakeWorker, ServerThread

pytestmark = pytest.mark.timeout(150)


def _wait(cond, timeout=30.0, step=0.05):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met"
        time.sleep(step)


def _body(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"session {i} " + "lorem ipsum " * 30}], "max_tokens": 2}


def _health(url: str) -> dict | None:
    try:
        return httpx.get(url + "/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


class Stack:
    """Fake prefill/decode workers in-process and two router processes over them."""

    def __init__(self, tmp_path, redis_url: str, delay_s: float = 0.15) -> None:
        model = build_tiny_model(tmp_path / "tiny")
        self.prefill = [FakeWorker(mode="prefill", name=f"p{i}", prefill_delay_s=delay_s) for i in range(2)]
        self.decode = [FakeWorker(mode="decode", name="d0", tokens=2, prefill_delay_s=delay_s)]
        self.servers = [ServerThread(w).start() for w in self.prefill + self.decode]
        cfg = {
            "model": {"name": "tiny", "path": str(model), "page_size": 16, "context_length": 8192},
            "router": {
                "policy": "least-load",
                "health_interval_s": 0.5,
                "load_poll": False,
                "redis_url": redis_url,
                "redis_heartbeat_s": 0.2,
                "redis_ttl_s": 1.0,
                "log_level": "warning",
                # one request per worker at a time: the others wait in the replicas' queues
                "dispatch": {"order": "slack", "readiness": {"max_queued_s": 4, "max_running": 1}},
            },
            "prefill": [{"url": s.url, "bootstrap_port": 9000 + i} for i, s in enumerate(self.servers[:2])],
            "decode": [{"url": self.servers[2].url}],
        }
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.urls, self.procs, self.logs = [], [], []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        for i in range(2):
            port = free_port()
            log = open(tmp_path / f"r{i}.log", "w")  # noqa: SIM115 - closed in close()
            argv = [sys.executable, "-m", "stack.cli", "router", "--config", str(path)]
            argv += ["--port", str(port), "--replica-id", f"r{i}"]
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
            self.logs.append(log)
            self.urls.append(f"http://127.0.0.1:{port}")
        for u in self.urls:
            _wait(lambda u=u: (_health(u) or {}).get("shared_state") == "up", timeout=60)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()
        for s in self.servers:
            s.stop()


def test_killed_replica_loses_no_request_of_the_survivor(tmp_path, redis_server):
    st = Stack(tmp_path, redis_server.url)
    r = redis_server.client()
    outcomes: dict[int, list] = {0: [], 1: []}
    heads_seen: set[bytes] = set()
    stop = {0: threading.Event(), 1: threading.Event()}
    lock = threading.Lock()

    def client(rep: int, k: int) -> None:
        i = 1000 * rep + 100 * k
        with httpx.Client(base_url=st.urls[rep], timeout=30) as c:
            while not stop[rep].is_set():
                i += 1
                try:
                    resp = c.post("/v1/chat/completions", json=_body(i))
                    out = (resp.status_code, resp.json().get("usage", {}).get("completion_tokens"))
                except httpx.HTTPError as e:  # the killed replica's own clients lose their connection
                    out = ("conn", type(e).__name__)
                with lock:
                    outcomes[rep].append(out)

    def watch_heads() -> None:
        while not stop[0].is_set():
            heads_seen.update(r.hkeys("smetric:heads"))
            time.sleep(0.02)

    threads = [threading.Thread(target=client, args=(rep, k)) for rep in (0, 1) for k in range(4)]
    threads.append(threading.Thread(target=watch_heads))
    try:
        for t in threads:
            t.start()
        time.sleep(2.5)  # 8 clients, 2 workers taking one request each: both queues hold requests
        st.procs[1].send_signal(signal.SIGKILL)  # a crash: no clean exit, its heartbeat just stops
        st.procs[1].wait(timeout=10)
        stop[1].set()
        time.sleep(3.0)  # the survivor keeps serving past the dead one's heartbeat expiry
        stop[0].set()
        for t in threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in threads)
        # both replicas took part in the one order: each published the rank of its next release
        assert {b"r0", b"r1"} <= heads_seen
        # every request the survivor accepted was served, before, during and after the kill
        assert len(outcomes[0]) >= 8
        assert all(o == (200, 2) for o in outcomes[0]), outcomes[0]
        # the killed replica's clients: served before the kill, then their connection is gone
        assert any(o == (200, 2) for o in outcomes[1])
        assert all(o == (200, 2) or o[0] == "conn" for o in outcomes[1]), outcomes[1]
        # nothing of the dead replica stays in the shared state: its heartbeat expired, and the
        # survivor's heartbeat dropped its rank, its figures and its membership
        _wait(lambda: r.smembers("smetric:replicas") == {b"r0"}, timeout=10)
        assert not r.exists("smetric:hb:r1")
        assert b"r1" not in r.hkeys("smetric:heads")
        assert not [f for f in r.hkeys("smetric:acct") if f.startswith(b"r1\t")]
        # the survivor's queue did hold requests (8 clients, 2 workers taking one each)
        text = httpx.get(st.urls[0] + "/metrics", timeout=5).text
        waits = _metric(text, 'smetric_dispatch_queue_wait_seconds_bucket{le="0.05"}')
        released = _metric(text, "smetric_dispatch_queue_wait_seconds_count")
        print(
            "survivor:",
            len(outcomes[0]),
            "served;",
            released,
            "released,",
            released - waits,
            "waited > 50 ms",
        )
        assert released >= len(outcomes[0]) and released - waits >= 4
        # and the survivor still serves, its queue not held back by a dead replica's rank
        t0 = time.monotonic()
        resp = httpx.post(st.urls[0] + "/v1/chat/completions", json=_body(9999), timeout=30)
        assert resp.status_code == 200 and time.monotonic() - t0 < 5.0
    finally:
        stop[0].set()
        stop[1].set()
        st.close()


def test_a_replica_waits_for_better_ranked_heads_and_stale_or_dead_ones_expire(redis_server):
    """The rule itself, against Redis: a replica releases only while fewer live replicas rank
    before it than workers are ready; a rank that does not move stops counting after
    head_stale_s, and a dead replica's rank is ignored and then dropped."""

    async def main():
        kw = dict(namespace="hc", heartbeat_s=0.1, ttl_s=0.5, flush_s=0.02, head_stale_s=0.4)
        regs = [WorkerRegistry(), WorkerRegistry()]
        for reg in regs:
            reg.add("prefill", "http://w0:1")
        a = SharedState(redis_server.url, regs[0], replica_id="a", **kw)
        b = SharedState(redis_server.url, regs[1], replica_id="b", **kw)
        for s in (a, b):
            s.heads.heads_on = True
            await s.start()
        pokes = []
        b.heads.on_heads.append(lambda: pokes.append(1))
        a.heads.set_head((0, 100.0, 90.0))
        b.heads.set_head((0, 105.0, 95.0))
        await asyncio.sleep(0.1)
        assert b.heads.others_heads["a"] == (0, 100.0, 90.0) and pokes
        assert b.heads.may_release((0, 105.0, 95.0), 2)  # two ready: both go
        assert a.heads.may_release((0, 100.0, 90.0), 1)
        assert b.heads.may_release((0, 99.0, 95.0), 1)  # b's next one is more urgent
        assert not b.heads.may_release((0, 105.0, 95.0), 1)  # a's head goes first on the one ready worker
        await asyncio.sleep(0.2)
        assert not b.heads.may_release((0, 105.0, 95.0), 1)  # still waiting for a's release
        # a's head has kept b waiting for head_stale_s without moving (a sees no ready
        # worker, or is stuck): it stops counting
        await asyncio.sleep(0.25)
        assert b.heads.may_release((0, 105.0, 95.0), 1)
        a.heads.set_head(None)  # a has nothing left: its rank leaves at once
        await asyncio.sleep(0.1)
        assert "a" not in b.heads.others_heads
        a.heads.set_head((1, 50.0, 40.0))
        await asyncio.sleep(0.1)
        assert not b.heads.may_release((2, 10.0, 5.0), 1)  # tier first: aged before deferred
        # a crashes (its loops stop, no clean exit): its rank is ignored once its heartbeat
        # expired, and b's heartbeat drops it from Redis
        for t in a._tasks:
            t.cancel()
        await asyncio.sleep(0.8)
        assert "a" not in b.heads.others_heads and b.heads.may_release((2, 10.0, 5.0), 1)
        assert b"a" not in redis_server.client().hkeys("hc:heads")
        await b.stop()
        assert b"b" not in redis_server.client().hkeys("hc:heads")  # a clean exit leaves at once
        a.conn.up = False
        await a.stop()

    asyncio.run(main())


def _in_process_replicas(tmp_path, redis_url: str, mode: str, delay_s: float):
    """One fake prefill worker taking one request at a time, and two router replicas in this
    process (each on its own uvicorn thread) releasing in plain deadline order."""
    from stack.prefill_router.service import create_app

    model = build_tiny_model(tmp_path / "tiny")
    prefill = FakeWorker(mode="prefill", name="p0", prefill_delay_s=delay_s)
    decode = FakeWorker(mode="decode", name="d0", tokens=2, prefill_delay_s=delay_s)
    servers = [ServerThread(w).start() for w in (prefill, decode)]
    apps, routers = [], []
    for i in range(2):
        cfg = parse_config(
            {
                "model": {"name": "tiny", "path": str(model), "page_size": 16, "context_length": 8192},
                "router": {
                    "policy": "least-load",
                    "health_interval_s": 0.5,
                    "load_poll": False,
                    "redis_url": redis_url,
                    "redis_namespace": f"order-{mode}",
                    "replica_id": f"r{i}",
                    "redis_heartbeat_s": 0.2,
                    "redis_ttl_s": 1.0,
                    "log_level": "warning",
                    "slo": {"b": 1.0, "a_per_1k": 1.0},
                    "dispatch": {
                        "order": "deadline",
                        "readiness": {"max_queued_s": 4, "max_running": 1},
                        "replica_mode": mode,
                    },
                },
                "prefill": [{"url": servers[0].url, "bootstrap_port": 9000}],
                "decode": [{"url": servers[1].url}],
            }
        )
        apps.append(create_app(cfg))
        routers.append(ServerThread(apps[-1]).start())
    return prefill, servers + routers, [a.state.router for a in apps]


def test_claims_release_in_one_deadline_order_across_replicas(tmp_path, redis_server):
    """While the one worker is busy, requests wait at both replicas with deadlines that
    interleave across them (the SLO grows with the prompt: 1 s per 1k tokens here, so the
    deadlines are about a second apart, far more than the spread of their arrivals); with
    claims they reach the worker in the cluster-wide deadline order. (With a queue each the
    replica that sees the worker free first, the one whose request just finished, releases
    its own head instead.)"""
    prefill, servers, states = _in_process_replicas(tmp_path, redis_server.url, "claims", delay_s=1.0)
    try:
        _wait(lambda: all(s.shared.up for s in states))
        for s in states:
            assert s.queue.claims.replicas is s.shared.heads
            s.shared.heads.head_stale_s = 5.0  # a slow machine never overrides a live rank here
        urls = [f"http://127.0.0.1:{srv.port}" for srv in servers[2:]]
        # (name, replica, prompt words): x occupies the worker; then e < d < c < b < a by deadline
        sends = [("x", 0, 10), ("a", 1, 1000), ("b", 0, 750), ("c", 1, 500), ("d", 0, 250), ("e", 1, 10)]
        results = {}

        def send(name: str, rep: int, words: int) -> None:
            body = {"messages": [{"role": "user", "content": f"order {name} " + "lorem " * words}]}
            results[name] = httpx.post(urls[rep] + "/v1/chat/completions", json=body, timeout=60)

        threads = []
        for k, args in enumerate(sends):
            threads.append(threading.Thread(target=send, args=args))
            threads[-1].start()
            if k == 0:  # x on the worker first, then the others while it holds the worker
                _wait(lambda: any(p != "/health" for p, *_ in prefill.records), timeout=10)
            time.sleep(0.04)
        for t in threads:
            t.join(timeout=60)
        assert all(results[n].status_code == 200 for n, _, _ in sends)
        seen = []
        for _, body, *_ in prefill.records:
            for n, _, _ in sends:
                if f"order {n} " in str(body) and n not in seen:
                    seen.append(n)
        assert seen == ["x", "e", "d", "c", "b", "a"], seen
    finally:
        for srv in servers[::-1]:
            srv.stop()
