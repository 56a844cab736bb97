"""A small, fast fake SGLang worker (raw ASGI): a CPU-cheap SGLang-protocol responder for the
router overhead bench (``python -m stack.worker.fake --ports ...``) and the router tests.

Speaks the parts of SGLang's HTTP protocol the router uses: ``/generate``,
``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE streams with usage),
``/v1/embeddings`` (in any mode: the emulator's deterministic vectors of the UTF-8 bytes of
each string, or of the token ids as given),
``/health``, ``/v1/loads`` (or the old ``/get_load`` ``{"load": N}``), ``/abort_request``,
``/v1/models``. In ``prefill`` mode it answers after the prefill delay with an empty
result (as a PD prefill server does); in ``decode`` / ``colocated`` mode it produces
``tokens`` output chunks. Faults: ``fail`` = "500" | "close" | "hang"; ``healthy=False``
makes ``/health`` answer 503.

A :class:`KVLink` shared by a prefill and a decode fake stands for the KV transfer of
SGLang's PD hand-off: the decode side answers only once the prefill side has finished the
same ``bootstrap_room`` (as a real decode worker waits for the KV), and gives up when the
router aborts its rid or the link's timeout passes. Without a link (the bench's separate
processes) decode answers at once.

Bodies are recorded (``records``) unless ``record=False`` (the bench).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from stack.ports import free_port
from stack.worker.http.shapes.embeddings import embedding_list


class KVLink:
    """The KV hand-off between fake prefill and decode workers in one process (each worker
    runs on its own thread's event loop, so the state is a locked set, polled)."""

    def __init__(self, timeout_s: float = 30.0, poll_s: float = 0.002) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._sent: set[int] = set()

    def sent(self, rooms: list[int]) -> None:
        """The prefill side finished these rooms: their KV is ready for decode."""
        with self._lock:
            self._sent.update(rooms)

    def _ready(self, rooms: list[int]) -> bool:
        with self._lock:
            if not all(r in self._sent for r in rooms):
                return False
            self._sent.difference_update(rooms)
            return True

    async def wait(self, rooms: list[int], aborted: Callable[[], bool]) -> bool:
        """True once every room's KV came; False if aborted or past the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not self._ready(rooms):
            if aborted() or time.monotonic() > deadline:
                return False
            await asyncio.sleep(self.poll_s)
        return True


def _as_list(v) -> list:
    return v if isinstance(v, list) else [] if v is None else [v]


@dataclass
class FakeWorker:
    mode: str = "decode"  # prefill | decode | colocated
    name: str = "w"
    tokens: int = 4
    chunk_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    fail: str | None = None
    #: seconds before a ``fail`` takes effect (a worker that fails late, e.g. mid-prefill)
    fail_delay_s: float = 0.0
    healthy: bool = True
    old_loads: bool = False
    record: bool = True
    records: list = field(default_factory=list)
    #: the request headers of each recorded body (lower-case names), in ``records`` order
    headers: list = field(default_factory=list)
    #: also answer /v1/messages and /v1/responses (as /generate) so the bodies the router
    #: sends there can be inspected
    agent_paths: bool = False
    aborts: list = field(default_factory=list)
    active: int = 0
    waiting_report: int = 0
    hang_event: asyncio.Event | None = None
    #: the KV hand-off shared with the other side of PD (None: decode does not wait)
    link: KVLink | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        method = scope["method"]
        if method == "GET":
            if path == "/health":
                return await _json(send, 200 if self.healthy else 503, {"ok": self.healthy})
            if path == "/v1/loads" and not self.old_loads:
                return await _json(
                    send,
                    200,
                    {
                        "loads": [
                            {
                                "num_running_reqs": self.active,
                                "num_waiting_reqs": self.waiting_report,
                                "token_usage": 0.1,
                            }
                        ]
                    },
                )
            if path == "/get_load" and self.old_loads:
                return await _json(send, 200, {"load": self.active + self.waiting_report})
            if path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
                return await _json(
                    send,
                    200,
                    {
                        "model_path": "tiny",
                        "served_model_name": "tiny",
                        "is_generation": True,
                        "disaggregation_mode": self.mode,
                    },
                )
            if path == "/v1/models":
                return await _json(send, 200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            return await _json(send, 404, {"detail": "Not Found"})
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/abort_request":
            self.aborts.append(orjson.loads(body).get("rid"))
            return await _json(send, 200, {})
        if path not in ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/embeddings") and not (
            self.agent_paths and path in ("/v1/messages", "/v1/responses")
        ):
            return await _json(send, 404, {"detail": "Not Found"})
        req = orjson.loads(body)
        if self.record:
            self.records.append((path, req, time.monotonic()))
            self.headers.append({k.decode().lower(): v.decode() for k, v in scope.get("headers", [])})
        if self.fail is not None and self.fail_delay_s > 0:
            await asyncio.sleep(self.fail_delay_s)
        if self.fail == "500":
            return await _json(send, 500, {"error": {"message": "boom", "type": "server_error"}})
        if self.fail == "400":
            return await _json(
                send, 400, {"error": {"message": "worker says no", "type": "invalid_request_error"}}
            )
        if self.fail == "close":
            raise RuntimeError("fake worker crash")  # uvicorn answers 500 / drops
        if self.fail == "hang":
            await asyncio.sleep(3600)
        if path == "/v1/embeddings":
            return await _json(send, 200, {**_embeddings(req), "worker": self.name})
        rooms = _as_list(req.get("bootstrap_room")) if self.link is not None else []
        if rooms and self.mode == "decode":
            rids = _as_list(req.get("rid"))  # any JSON a client sent (a list: no hashing)
            if not await self.link.wait(rooms, lambda: any(r in rids for r in self.aborts)):
                return await _json(
                    send, 500, {"error": {"message": "KV transfer failed", "type": "server_error"}}
                )
        self.active += 1
        try:
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
            if rooms and self.mode == "prefill":
                self.link.sent(rooms)
            if self.mode == "prefill":
                return await _json(
                    send, 200, {"text": "", "meta_info": {"id": req.get("rid"), "finish_reason": None}}
                )
            stream = bool(req.get("stream"))
            n = self.tokens
            if not stream:
                return await _json(send, 200, _final(path, self.name, n))
            await self._stream(send, path, n)
        finally:
            self.active -= 1

    async def _stream(self, send, path: str, n: int) -> None:
        """A streamed answer of ``n`` chunks in ``path``'s shape."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        if path == "/v1/messages":  # Anthropic's named events, as SGLang streams them
            for frame in _anthropic_frames(n):
                if self.chunk_delay_s and b"content_block_delta" in frame:
                    await asyncio.sleep(self.chunk_delay_s)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        for i in range(n):
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            chunk = b"data: " + orjson.dumps(_chunk(path, self.name, i)) + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = b"data: " + orjson.dumps(_usage_chunk(path, n)) + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _anthropic_frames(n: int) -> list[bytes]:
    """A streamed Anthropic message of ``n`` text deltas ("t0 ", "t1 ", ...)."""

    def ev(d: dict) -> bytes:
        return b"event: " + d["type"].encode() + b"\ndata: " + orjson.dumps(d) + b"\n\n"

    msg = {"id": "msg_fake", "type": "message", "role": "assistant", "model": "tiny", "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}  # fmt: skip
    frames = [ev({"type": "message_start", "message": msg}),
              ev({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})]  # fmt: skip
    for i in range(n):
        frames.append(
            ev({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": f"t{i} "}})
        )
    frames += [ev({"type": "content_block_stop", "index": 0}),
               ev({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                   "usage": {"output_tokens": n}}),
               ev({"type": "message_stop"})]  # fmt: skip
    return frames


def _final(path: str, name: str, n: int) -> dict:
    text = "".join(f"t{i} " for i in range(n))
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    if path == "/v1/chat/completions":
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": usage,
            "worker": name,
        }
    if path == "/v1/messages":
        return {
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": "tiny",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": n},
            "worker": name,
        }
    if path == "/v1/completions":
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "choices": [{"index": 0, "text": text}],
            "usage": usage,
            "worker": name,
        }
    return {"text": text, "meta_info": {"prompt_tokens": 1, "completion_tokens": n}, "worker": name}


def _embeddings(req: dict) -> dict:
    """The embeddings answer to a valid OpenAI body (the router checked it)."""
    inp = req.get("input")
    items = [inp] if isinstance(inp, str) or (inp and isinstance(inp[0], int)) else inp
    prompts = [list(x.encode()) if isinstance(x, str) else list(x) for x in items]
    return embedding_list(prompts, req.get("model") or "tiny")


def _chunk(path: str, name: str, i: int) -> dict:
    if path == "/v1/chat/completions":
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": f"t{i} "}}],
            "worker": name,
        }
    if path == "/v1/completions":
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "choices": [{"index": 0, "text": f"t{i} "}],
            "worker": name,
        }
    return {"text": f"t{i} ", "worker": name}


def _usage_chunk(path: str, n: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}


async def _json(send, status: int, obj) -> None:
    data = orjson.dumps(obj)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


class ServerThread:
    """Run an ASGI app with uvicorn on 127.0.0.1 in a daemon thread.

    With no fixed port, a free one is picked; a lost race for it is retried on another.
    """

    def __init__(self, app, port: int | None = None, lifespan: str = "on") -> None:
        self.app = app
        self.fixed = port is not None
        self.lifespan = lifespan
        self._make(port or free_port())

    def _make(self, port: int) -> None:
        import uvicorn

        self.port = port
        self.config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            lifespan=self.lifespan,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn exits when it cannot bind
            pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> ServerThread:
        for attempt in range(3):
            self.thread.start()
            t0 = time.monotonic()
            while not self.server.started:
                if not self.thread.is_alive():
                    break
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError("server did not start")
                time.sleep(0.01)
            if self.server.started:
                return self
            if self.fixed or attempt == 2:
                raise RuntimeError(f"server could not bind 127.0.0.1:{self.port}")
            self._make(free_port())
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - used by the bench
    """Serve fake workers on several ports from one process (one event loop)."""
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description="fast fake SGLang workers")
    ap.add_argument("--ports", required=True, help="comma-separated ports")
    ap.add_argument("--mode", default="decode")
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args(argv)
    servers = []
    for port in (int(x) for x in a.ports.split(",")):
        app = FakeWorker(mode=a.mode, tokens=a.tokens, record=False, name=str(port))
        cfg = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off"
        )
        servers.append(uvicorn.Server(cfg))

    async def serve_all():
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve_all())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
