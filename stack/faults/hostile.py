"""One hostile client against a live stack (issue 41): a 64 MB request header, then 1,000
connections that send part of a body and wait, each while a stream of small requests from
other clients runs. The stream must see no error, no worker may be ejected, and the stream's
p99 must stay within 2x of the quiet p99 measured just before, in the same run.

The hostile traffic comes from threads of this process over plain sockets; the stream is an
httpx client with a few requests in flight, its latency measured per request.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx

from stack.faults.harness import Counts, FaultStack, request_outcome
from stack.prefill_router.front_door import raise_open_files

#: the hostile header's size, and the chunks it is sent in
HEADER_BYTES = 64 << 20
_CHUNK = 1 << 16
#: slow bodies held open at once
SLOW_BODIES = 1000
#: in-flight requests of the stream
STREAM_CONCURRENCY = 4
#: the stream's p99 may grow to this many times the quiet one
P99_FACTOR = 2.0


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(0.99 * len(s)) - 1))]


def small_requests(n: int, seed: int) -> list[tuple[str, dict]]:
    """``n`` small requests: a short chat and a short ``/generate`` in turn, 2 new tokens each."""
    out: list[tuple[str, dict]] = []
    for i in range(n):
        k = seed * 100_000 + i
        if i % 2:
            ids = [(k * 31 + j * 7) % 30000 + 1 for j in range(32)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
            out.append(("/generate", body))
        else:
            msgs = [{"role": "user", "content": f"request {k}: say hi"}]
            out.append(("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}))
    return out


@dataclass
class Stream:
    """What a stream of requests saw: its counts and each request's latency (seconds)."""

    counts: Counts = field(default_factory=Counts)
    latencies: list[float] = field(default_factory=list)

    @property
    def p99(self) -> float:
        return p99(self.latencies)


async def _stream(url: str, bodies: list[tuple[str, dict]], deadline_s: float) -> Stream:
    out = Stream()
    sem = asyncio.Semaphore(STREAM_CONCURRENCY)
    limits = httpx.Limits(max_connections=STREAM_CONCURRENCY, max_keepalive_connections=STREAM_CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=deadline_s + 5, limits=limits) as client:

        async def one(path: str, body: dict) -> None:
            async with sem:
                t0 = time.perf_counter()
                kind, reason = await request_outcome(client, path, body, deadline_s)
                out.latencies.append(time.perf_counter() - t0)
                out.counts.add(kind, reason)

        await asyncio.gather(*(one(p, b) for p, b in bodies))
    return out


def stream(url: str, n: int, seed: int, deadline_s: float) -> Stream:
    """Send ``n`` small requests, :data:`STREAM_CONCURRENCY` in flight."""
    return asyncio.run(_stream(url, small_requests(n, seed), deadline_s))


def _answer_status(s: socket.socket) -> int | None:
    """The status of the answer on ``s`` (None: closed without one)."""
    buf = b""
    s.settimeout(10)
    try:
        while b"\r\n" not in buf:
            got = s.recv(4096)
            if not got:
                break
            buf += got
    except OSError:
        pass
    return int(buf.split(b" ", 2)[1]) if buf.startswith(b"HTTP/1.1 ") else None


class HostileHeaders(threading.Thread):
    """Sends requests with a :data:`HEADER_BYTES` header, one after another (``pause_s``
    apart), until stopped; ``statuses``: what each was answered (None: closed, no answer)."""

    def __init__(self, port: int, pause_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.pause_s = pause_s
        self.statuses: list[int | None] = []
        self.sent_bytes = 0
        self.done = threading.Event()

    def run(self) -> None:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Big: "
        chunk = b"a" * _CHUNK
        while not self.done.is_set():
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
                try:
                    s.sendall(head)
                    for _ in range(HEADER_BYTES // _CHUNK):
                        s.sendall(chunk)
                        self.sent_bytes += _CHUNK
                except OSError:
                    pass  # the router closed it: the rest is refused by the kernel
                self.statuses.append(_answer_status(s))
            self.done.wait(self.pause_s)

    def stop(self) -> None:
        self.done.set()
        self.join(60)


def open_slow_bodies(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, each with a request whose body has begun and waits for the rest."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(head + b'{"prompt": "')
        socks.append(s)
    return socks


def still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the router has neither answered nor closed."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            s.recv(1, socket.MSG_PEEK)  # an answer, or b"": closed
        except BlockingIOError:
            n += 1  # nothing to read: still waiting for the rest of its body
        except OSError:
            pass
    return n


def describe(name: str, quiet: Stream, loaded: Stream) -> str:
    """One note: the loaded stream's p99 and median against the quiet one's."""

    def median(x: Stream) -> float:
        return sorted(x.latencies)[len(x.latencies) // 2] * 1000

    return (
        f"{name}: stream p99 {loaded.p99 * 1000:.1f} ms vs {quiet.p99 * 1000:.1f} ms quiet "
        f"(x{loaded.p99 / quiet.p99:.2f}; median {median(loaded):.1f} vs {median(quiet):.1f} ms), "
        f"{loaded.counts.row()}"
    )


class HeadersLoad:
    """:class:`HostileHeaders` running for the duration of a ``with``."""

    def __init__(self, port: int) -> None:
        self.sender = HostileHeaders(port)

    def __enter__(self) -> HostileHeaders:
        self.sender.start()
        time.sleep(0.2)  # the first 64 MB header is on its way
        return self.sender

    def __exit__(self, *exc) -> None:
        self.sender.stop()


class SlowBodiesLoad:
    """:func:`open_slow_bodies` held open for the duration of a ``with``."""

    def __init__(self, port: int, n: int = SLOW_BODIES) -> None:
        self.port, self.n = port, n
        self.socks: list[socket.socket] = []

    def __enter__(self) -> list[socket.socket]:
        raise_open_files(self.n + 1024)
        self.socks = open_slow_bodies(self.port, self.n)
        self._wait_accepted()
        return self.socks

    def _wait_accepted(self, timeout_s: float = 30.0) -> None:
        """Until the router holds all of them (``smetric_open_connections``): the stream then
        runs while they wait, not while the router accepts them."""
        t0 = time.monotonic()
        with httpx.Client(timeout=10) as c:
            while time.monotonic() - t0 < timeout_s:
                for line in c.get(f"http://127.0.0.1:{self.port}/metrics").text.splitlines():
                    if line.startswith("smetric_open_connections ") and float(line.split()[1]) > self.n:
                        return
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        for s in self.socks:
            s.close()


def refusals(s: FaultStack) -> dict[str, float]:
    """The router's front-door refusals by reason."""
    out: dict[str, float] = {}
    for line in s.http.get(s.url + "/metrics").text.splitlines():
        if line.startswith("smetric_front_door_refusals_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out
