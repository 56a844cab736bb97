"""One client cannot hurt the others (issue 41): the router's front door (``router.front_door``),
calls retried on a fresh connection before they count against a worker, no pool-wide ejection
when the router itself stalls, and a client gone mid-body counted as the client's.

Each test is one probe of the issue, on loopback: a 64 MB header, too many headers, a head or a
body that never ends, 1,000 slow bodies at once, idle kept-alive connections, more connections
than the limit, a client that leaves while sending its body, a stale pooled connection, and a
stall of the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time

import aiohttp
import orjson
import pytest

from stack.decode_router.handoff import PDForwarder
from stack.decode_router.upstream import make_session
from stack.models.tiny import build_tiny_model
from stack.pool import LoopWatch, WorkerRegistry
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)

DOOR = {
    "max_header_bytes": 16 * 1024,
    "max_headers": 40,
    "header_timeout_s": 1.0,
    "body_timeout_s": 1.5,
    "keep_alive_s": 1.0,
    "max_connections": 1500,
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, n_prefill=2, n_decode=1, router={"front_door": DOOR})
    yield c
    c.close()


def metric(c: Cluster, name: str, **labels) -> float:
    total = 0.0
    for line in c.client.get("/metrics").text.splitlines():
        if not line.startswith(name) or line[len(name)] not in " {":
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _connect(c: Cluster) -> socket.socket:
    return socket.create_connection(("127.0.0.1", c.router.port), timeout=30)


def _answer(s: socket.socket) -> tuple[int, dict, dict] | None:
    """Read one whole answer (the server closes or says its length): (status, headers, JSON
    body), or None when the connection closed without one."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            got = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            got = b""
        if not got:
            return None
        buf += got
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {
        k.strip().lower().decode(): v.strip().decode() for k, _, v in (x.partition(b":") for x in lines[1:])
    }
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        got = s.recv(65536)
        if not got:
            break
        body += got
    return int(lines[0].split(b" ")[1]), headers, orjson.loads(body) if body else {}


def _openai_error(body: dict, code: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, body


def _closed(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


# -- the head ---------------------------------------------------------------------------------------
def test_a_64mb_header_is_refused_at_the_door_while_others_are_served(cluster):
    before = metric(cluster, "smetric_front_door_refusals_total", reason="header_too_large")
    got: dict = {}

    def hostile() -> None:
        with _connect(cluster) as s:
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: "
            try:
                s.sendall(head)
                for _ in range(1024):  # 64 MB, 64 KB at a time
                    s.sendall(b"a" * 65536)
            except OSError:
                pass  # the router closed it: the rest is refused by the kernel
            got["answer"] = _answer(s)

    t = threading.Thread(target=hostile)
    t.start()
    statuses = [cluster.client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(10)]
    t.join(60)
    assert statuses == [200] * 10
    status, headers, body = got["answer"]
    assert status == 431 and headers["connection"] == "close"
    _openai_error(body, "header_too_large")
    assert metric(cluster, "smetric_front_door_refusals_total", reason="header_too_large") == before + 1
    assert metric(cluster, "smetric_ejections_total") == 0


def test_too_many_headers_are_refused_in_the_apis_shape(cluster):
    with _connect(cluster) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 41 + b"\r\n")
        status, _, body = _answer(s)
    assert status == 431
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    with _connect(cluster) as s:  # at the limit: served
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 39 + b"\r\n")
        assert _answer(s)[0] == 200


def test_a_head_that_never_ends_gets_408_and_a_silent_connection_is_closed(cluster):
    with _connect(cluster) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        status, headers, body = _answer(s)
    assert status == 408 and headers["connection"] == "close"
    _openai_error(body, "request_timeout")
    with _connect(cluster) as s:  # connected, nothing sent: closed, nothing to answer
        assert _closed(s, 10)


def test_an_idle_kept_alive_connection_is_closed(cluster):
    with _connect(cluster) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(s)[0] == 200
        assert _closed(s, 10)  # router.front_door.keep_alive_s: 1


# -- the body -----------------------------------------------------------------------------------------
def test_a_body_that_never_ends_gets_408_in_the_apis_shape_and_is_counted(cluster):
    before = metric(cluster, "smetric_requests_total", endpoint="messages", status="408")
    gone = metric(cluster, "smetric_client_disconnects_total", endpoint="messages")
    with _connect(cluster) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        status, headers, body = _answer(s)
    assert status == 408 and headers["connection"] == "close"
    assert body == {
        "type": "error",
        "error": {"type": "request_timeout_error", "message": "request body not received within 1.5 s"},
    }
    cluster.wait_for(
        lambda: metric(cluster, "smetric_requests_total", endpoint="messages", status="408") == before + 1
    )
    assert metric(cluster, "smetric_client_disconnects_total", endpoint="messages") == gone + 1


def test_a_client_gone_mid_body_is_its_own_doing(cluster, caplog):
    before = metric(cluster, "smetric_requests_total", endpoint="chat", status="499")
    gone = metric(cluster, "smetric_client_disconnects_total", endpoint="chat")
    with caplog.at_level(logging.DEBUG):
        with _connect(cluster) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.2)  # its handler is reading the body
        cluster.wait_for(
            lambda: metric(cluster, "smetric_requests_total", endpoint="chat", status="499") == before + 1
        )
    assert metric(cluster, "smetric_client_disconnects_total", endpoint="chat") == gone + 1
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]  # no internal error, no traceback
    assert any("client gone while its body was read" in r.getMessage() for r in caplog.records)


def _raise_open_files(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n:
        pytest.skip(f"needs {n} open files")


def test_1000_slow_bodies_are_cut_off_and_others_are_served(cluster):
    _raise_open_files(4096)  # 1,000 sockets here and 1,000 in the router (same process)
    before = metric(cluster, "smetric_front_door_refusals_total", reason="body_timeout")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    slow = []
    try:
        for _ in range(1000):
            s = _connect(cluster)
            s.sendall(head + b'{"prompt": "')
            slow.append(s)
        statuses = [cluster.client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(10)]
        assert statuses == [200] * 10  # served while the 1,000 wait
        answers = [_answer(s) for s in slow]  # each cut off: 408, closed
    finally:
        for s in slow:
            s.close()
    assert [a[0] if a else None for a in answers] == [408] * 1000
    cluster.wait_for(
        lambda: metric(cluster, "smetric_front_door_refusals_total", reason="body_timeout") == before + 1000
    )
    assert metric(cluster, "smetric_ejections_total") == 0


def test_connections_past_the_limit_get_503_in_the_apis_shape(model_dir):
    c = Cluster(model_dir, n_prefill=1, n_decode=1, router={"front_door": {**DOOR, "max_connections": 8}})
    socks = []
    try:
        for _ in range(12):
            socks.append(_connect(c))
        time.sleep(0.2)  # all accepted
        for s in socks:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [_answer(s) for s in socks]
    finally:
        for s in socks:
            s.close()
        c.close()
    statuses = [a[0] for a in answers]
    assert set(statuses) == {200, 503} and statuses.count(503) >= 4, statuses
    for status, headers, body in answers:
        if status == 503:
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            _openai_error(body, "overloaded")


# -- calls to workers ------------------------------------------------------------------------------
class _ClosingWorker:
    """A worker that answers each call, then closes its connection without saying so: a pooled
    connection it leaves behind is stale (as a worker's idle keep-alive running out while the
    router stood still leaves it)."""

    def __init__(self) -> None:
        self.calls = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(
            next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1]
        )
        await reader.readexactly(n)
        self.calls += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


def test_a_call_on_a_stale_pooled_connection_is_retried_on_a_fresh_one():
    async def go(retry: bool) -> tuple[int | str, int, int]:
        w = _ClosingWorker()
        port = await w.start()
        url = f"http://127.0.0.1:{port}/generate"
        async with make_session() as pooled, make_session(fresh=True) as fresh:
            fwd = PDForwarder(pooled, fresh=fresh if retry else None)
            fwd.stale_retries = count = _Count()
            r = await fwd.post(url, b"{}", {})
            await r.read()
            r.release()  # back to the pool; the worker closes its end
            time.sleep(0.3)  # the router's loop stands still: the close is not seen yet
            try:
                r = await fwd.post(url, b"{}", {})
                out: int | str = r.status
                r.release()
            except aiohttp.ClientError as e:
                out = type(e).__name__
        w.server.close()
        return out, count.n, w.calls

    assert asyncio.run(go(retry=False))[0] in ("ServerDisconnectedError", "ClientOSError")  # the probe
    assert asyncio.run(go(retry=True)) == (200, 1, 2)


def test_failed_calls_eject_only_in_a_row_and_never_the_last_healthy_worker():
    reg = WorkerRegistry(eject_cooldown_s=0)
    a, b = reg.add("prefill", "http://127.0.0.1:1"), reg.add("prefill", "http://127.0.0.1:2")
    reg.call_failed(a, 3)
    reg.call_failed(a, 3)
    reg.call_ok(a)  # a call that passed ends the run
    reg.call_failed(a, 3)
    reg.mark_ok(a)  # a passing health check ends the mixed run, not the run of failed calls
    reg.call_failed(a, 3)
    assert a.healthy and (a.fails, a.call_fails) == (1, 2)
    reg.call_failed(a, 3)
    assert not a.healthy  # three failed calls in a row
    for _ in range(5):
        reg.call_failed(b, 3)
    assert b.healthy  # the last healthy prefill worker: left to its health checks
    reg.mark_failed(b, 3)
    reg.mark_failed(b, 3)
    assert not b.healthy  # which can eject it


def test_the_loop_watch_tells_a_stall():
    w = LoopWatch(tick_s=0.05, stall_s=0.5)
    t0 = time.monotonic()
    w.tick(t0 + 0.06)
    assert not w.stalled_since(t0) and w.stalls == 0
    w.tick(t0 + 1.0)  # 0.89 s late
    assert w.stalled_since(t0) and w.stalls == 1
    assert not w.stalled_since(t0 + 1.5)


def test_stalls_of_the_router_eject_no_worker(model_dir):
    # two stalls of the router's event loop, 0.15 s apart: the health checks in flight at each
    # time out (two failures in a row, router.health_failures 2), and the workers close idle
    # pooled connections meanwhile (their keep-alive: 0.2 s)
    rc = {"health_interval_s": 0.2, "health_timeout_s": 0.5, "health_failures": 2}
    c = Cluster(model_dir, n_prefill=2, n_decode=1, router=rc, worker_keep_alive_s=0.2)
    try:
        for _ in range(6):
            assert c.client.post("/v1/chat/completions", json=CHAT).status_code == 200
        loop = c.state.health._task.get_loop()
        loop.call_soon_threadsafe(time.sleep, 1.0)
        time.sleep(1.15)
        loop.call_soon_threadsafe(time.sleep, 1.0)
        time.sleep(0.1)
        statuses: list[int] = []

        def send() -> None:
            statuses.append(c.client.post("/v1/chat/completions", json=CHAT).status_code)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert statuses == [200] * 8
        assert c.state.watch.stalls >= 2
        assert all(w.healthy for w in c.state.registry.workers.values())
        assert metric(c, "smetric_ejections_total") == 0
    finally:
        c.close()
