"""Work that stops when the client leaves, on emulated PD workers run with SGLang's
``--api-key`` and ``--admin-api-key`` (the router sends the first on every call, the second on
``/abort_request``, the only key SGLang accepts there once it is set).

A client that leaves before the first token (prefill running, decode waiting for the KV), in
the middle of a stream, before a non-streamed answer, or while its request waits in the
router's queue: both workers' running and waiting counts return to zero, no page of their KV
stays held, no PD rendezvous stays open, the router's bookings are released, and the workers
received ``/abort_request`` for it (SGLang itself would notice a gone client only on its next
4 s check). Each case in OpenAI's shape (chat; Responses) and Anthropic's (Messages).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from stack.config import parse_config
from stack.ports import free_port
from stack.prefill_router.service import create_app
from stack.worker.fake import ServerThread
from stack.worker.http.app import build_app
from stack.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(120)

API_KEY = "worker-api-key-0123"
ADMIN_KEY = "worker-admin-key-4567"


class EmulatedPD:
    """One emulated prefill and one decode worker (in-process, keys required) and the router."""

    def __init__(self, monkeypatch, router: dict | None = None) -> None:
        monkeypatch.setenv("SMETRIC_TEST_WKEY", API_KEY)
        monkeypatch.setenv("SMETRIC_TEST_WADMIN", ADMIN_KEY)
        # time_factor 2: an 8k-token prefill takes seconds; decode 0.2 s a token
        common = dict(
            time_factor=2.0,
            kv_transport="http",
            decode_tpot_s=0.1,
            api_key=API_KEY,
            admin_api_key=ADMIN_KEY,
            page_size=16,
        )
        pport = free_port()
        papp, self.p = build_app(WorkerSettings(mode="prefill", port=pport, name="p0", **common))
        dapp, self.d = build_app(WorkerSettings(mode="decode", name="d0", **common))
        self.servers = [ServerThread(papp, port=pport).start(), ServerThread(dapp).start()]
        rc = {
            "policy": "round-robin",
            "health_interval_s": 0.5,
            "auth": {
                "worker_api_key_env": "SMETRIC_TEST_WKEY",
                "worker_admin_api_key_env": "SMETRIC_TEST_WADMIN",
            },
        }
        rc.update(router or {})
        cfg = parse_config(
            {
                "model": {"name": "m", "page_size": 16},
                "router": rc,
                "prefill": [{"url": self.servers[0].url, "bootstrap_port": pport}],
                "decode": [{"url": self.servers[1].url}],
            }
        )
        self.app = create_app(cfg)
        self.state = self.app.state.router
        self.router = ServerThread(self.app).start()
        self.url = self.router.url
        self._wait(lambda: all(w.healthy for w in self.state.registry.workers.values()), "workers healthy")

    def counts(self) -> dict[str, dict[str, int]]:
        """Per worker: requests running (prefilling, handing off, decoding) and waiting, pages
        held by requests, open PD rooms, /abort_request calls received, requests received."""
        out = {}
        for name, w in (("prefill", self.p), ("decode", self.d)):
            e = w.engine
            out[name] = {
                "running": len(e.scheduler.running) + len(e.scheduler.fetching) + len(e.decoding),
                "waiting": len(e.scheduler.waiting),
                "held_pages": sum(1 for b in list(e.cache.blocks.values()) if b.ref),
                "open_rooms": len(e.handoff.rooms),
                "abort_requests": e.c.abort_requests,
                "requests": e.c.requests,
            }
        return out

    def idle(self) -> bool:
        c = self.counts()
        return all(v["running"] == 0 and v["waiting"] == 0 and v["held_pages"] == 0 for v in c.values()) and (
            c["prefill"]["open_rooms"] == 0
        )

    def router_idle(self) -> bool:
        return all(w.inflight == 0 for w in self.state.registry.workers.values())

    def _wait(self, cond, what: str, timeout: float = 20.0) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"{what}: not reached; {self.counts()}"
            time.sleep(0.02)
        return time.monotonic() - t0

    def close(self) -> None:
        self.router.stop()
        for s in self.servers:
            s.stop()


@pytest.fixture
def pd(monkeypatch):
    c = EmulatedPD(monkeypatch)
    yield c
    c.close()


def _body(path: str, words: int, max_tokens: int = 200, stream: bool = True) -> dict:
    """A request in ``path``'s shape. ``ignore_eos`` in every shape (the emulated model may end
    a short answer early, before the client leaves; the emulator honours it on all three)."""
    text = "explain the code " * words
    if path == "/v1/responses":
        return {
            "model": "m",
            "max_output_tokens": max_tokens,
            "stream": stream,
            "input": text,
            "ignore_eos": True,
        }
    return {
        "model": "m",
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
        "ignore_eos": True,
    }


SHAPES = ["/v1/chat/completions", "/v1/messages", "/v1/responses"]


def _gone_and_freed(pd: EmulatedPD, before: dict, both: bool = True) -> None:
    """After the client left: the work on the workers ends, their KV is released, the router's
    bookings too, and the router told the workers (both, or decode only) to abort it."""
    pd._wait(pd.idle, "workers idle")
    pd._wait(pd.router_idle, "router bookings released")
    for role in ("prefill", "decode") if both else ("decode",):
        n = before[role]["abort_requests"]
        pd._wait(lambda role=role, n=n: pd.counts()[role]["abort_requests"] > n, f"/abort_request on {role}")


@pytest.mark.parametrize("path", SHAPES)
def test_leaving_before_the_first_token(pd, path):
    """The prompt is still prefilling and decode waits for its KV when the client leaves."""
    before = pd.counts()

    async def go():
        async with httpx.AsyncClient(base_url=pd.url, timeout=60) as c:
            t = asyncio.create_task(c.post(path, json=_body(path, words=2000)))
            for _ in range(1000):
                n = pd.counts()
                if n["prefill"]["running"] + n["prefill"]["waiting"] and n["decode"]["running"]:
                    break
                await asyncio.sleep(0.01)
            assert not t.done(), "the prefill finished before the client could leave"
            t.cancel()

    asyncio.run(go())
    _gone_and_freed(pd, before)


@pytest.mark.parametrize("path", SHAPES)
def test_leaving_mid_stream(pd, path):
    """After 3 chunks of a 200-token stream (40 s at 0.2 s a token)."""
    before = pd.counts()

    async def go():
        async with httpx.AsyncClient(base_url=pd.url, timeout=60) as c:
            async with c.stream("POST", path, json=_body(path, words=50)) as r:
                assert r.status_code == 200
                n = 0
                async for _ in r.aiter_raw():
                    n += 1
                    if n == 3:
                        # still generating when the client leaves: checked before it leaves, since
                        # the router may abort the decode as soon as the connection closes
                        for _ in range(500):
                            if pd.counts()["decode"]["running"] == 1:
                                break
                            await asyncio.sleep(0.01)
                        assert pd.counts()["decode"]["running"] == 1
                        break

    asyncio.run(go())
    _gone_and_freed(pd, before)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_leaving_before_a_non_streamed_answer(pd, path):
    before = pd.counts()

    async def go():
        async with httpx.AsyncClient(base_url=pd.url, timeout=60) as c:
            t = asyncio.create_task(c.post(path, json=_body(path, words=50, stream=False)))
            for _ in range(1000):
                if pd.counts()["decode"]["running"] and pd.counts()["prefill"]["running"] == 0:
                    break  # prefill done, decoding
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            assert not t.done()
            t.cancel()

    asyncio.run(go())
    _gone_and_freed(pd, before)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_leaving_while_queued(monkeypatch, path):
    """A request waiting in the router's queue (one running request at a time) never reaches
    a worker once its client left; the one holding the worker is then abandoned too."""
    pd = EmulatedPD(monkeypatch, router={"dispatch": {"order": "deadline", "readiness": {"max_running": 1}}})
    try:
        q = pd.state.queue

        async def go():
            async with httpx.AsyncClient(base_url=pd.url, timeout=60) as c:
                first = asyncio.create_task(c.post(path, json=_body(path, words=2000)))
                for _ in range(1000):
                    if pd.counts()["prefill"]["requests"]:
                        break
                    await asyncio.sleep(0.01)
                second = asyncio.create_task(c.post(path, json=_body(path, words=30)))
                for _ in range(1000):
                    if q.depth == 1:
                        break
                    await asyncio.sleep(0.01)
                assert q.depth == 1, "the second request is not waiting in the queue"
                second.cancel()
                for _ in range(1000):
                    if q.depth == 0:
                        break
                    await asyncio.sleep(0.01)
                assert q.depth == 0
                first.cancel()

        asyncio.run(go())
        _gone_and_freed(pd, {"prefill": {"abort_requests": 0}, "decode": {"abort_requests": 0}})
        assert pd.counts()["prefill"]["requests"] == 1 and pd.counts()["decode"]["requests"] == 1
        assert q.metrics.cancelled._value.get() == 1
    finally:
        pd.close()


def test_emulator_keys_as_sglang_checks_them(pd):
    """The emulated worker's keys (SGLang 0.5.23's rules): /health and /metrics open, the API
    key everywhere else, the admin key alone on /abort_request; keys never in /server_info."""
    p = pd.servers[0].url
    with httpx.Client(timeout=10) as c:
        assert c.get(p + "/health").status_code == 200
        assert c.get(p + "/metrics").status_code == 200
        r = c.get(p + "/v1/loads")
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        api = {"Authorization": f"Bearer {API_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert c.get(p + "/v1/loads", headers=api).status_code == 200
        assert c.get(p + "/v1/loads", headers=admin).status_code == 401
        assert c.post(p + "/abort_request", json={"rid": "x"}, headers=api).status_code == 401
        assert c.post(p + "/abort_request", json={"rid": "x"}, headers=admin).status_code == 200
        info = c.get(p + "/server_info", headers=api).text
        assert API_KEY not in info and ADMIN_KEY not in info
    # and the router's load polls carry the key: it sees the worker's counts
    pd._wait(lambda: all(w.polled_at for w in pd.state.registry.workers.values()), "load polls answered")


def test_without_the_admin_key_aborts_are_refused(monkeypatch, caplog):
    """Negative control: a router given the workers' API key but not their admin key has its
    aborts refused (SGLang's ADMIN_OPTIONAL rule), which the router logs."""
    pd = EmulatedPD(monkeypatch, router={"auth": {"worker_api_key_env": "SMETRIC_TEST_WKEY"}})
    caplog.set_level("WARNING", logger="stack.decode_router")
    try:
        before = pd.counts()

        async def go():
            async with httpx.AsyncClient(base_url=pd.url, timeout=60) as c:
                async with c.stream(
                    "POST", "/v1/chat/completions", json=_body("/v1/chat/completions", 50)
                ) as r:
                    n = 0
                    async for _ in r.aiter_raw():
                        n += 1
                        if n == 3:
                            break

        asyncio.run(go())
        pd._wait(pd.router_idle, "router bookings released")
        pd._wait(lambda: "worker_admin_api_key_env" in caplog.text, "the refused abort logged")
        assert "refused (401)" in caplog.text
        assert pd.counts()["decode"]["abort_requests"] == before["decode"]["abort_requests"]
    finally:
        pd.close()
