"""The fault harness: how one answer is classified (ok, clean error, lost), counting a
driven batch of requests, and :class:`FaultStack`, the loopback processes (emulated workers,
the router, mooncake_master) a scenario starts, kills and restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

from stack.launch.loopback import Master, Procs, wait_http, wait_worker
from stack.ports import free_port

ADMIN_ENV = "SMETRIC_ADMIN_TOKEN"
PAGE = 16


# -- classifying one answer -------------------------------------------------------------------------
def _aborted(obj: dict) -> bool:
    ch = obj.get("choices")
    if isinstance(ch, list):
        for c in ch:
            if isinstance(c, dict) and c.get("finish_reason") == "abort":
                return True
    mi = obj.get("meta_info")
    if isinstance(mi, dict):
        fr = mi.get("finish_reason")
        if isinstance(fr, dict) and fr.get("type") == "abort":
            return True
    return False


def _has_text(obj: dict) -> bool:
    """Whether an answer (or one streamed event) carries output text or a tool call."""
    if obj.get("text"):
        return True
    ch = obj.get("choices")
    if isinstance(ch, list):
        for c in ch:
            if not isinstance(c, dict):
                continue
            if c.get("text"):
                return True
            for part in (c.get("delta"), c.get("message")):
                if isinstance(part, dict) and (part.get("content") or part.get("tool_calls")):
                    return True
    return False


def classify_error(status: int, data: bytes) -> tuple[str, str]:
    """A non-200 answer: clean when its body is ``{"error": {"message": str, ...}}``."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "lost", f"{status} without a JSON body"
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return "clean", f"{status} {err.get('code') or err.get('type')}"
    return "lost", f"{status} without an OpenAI-shaped error"


def classify_json(data: bytes) -> tuple[str, str]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "lost", "200 with a malformed JSON body"
    if not isinstance(obj, dict | list):
        return "lost", "200 with a non-object body"
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return "clean", "200 with an error object"
    if isinstance(obj, dict) and _aborted(obj):
        if not _has_text(obj):  # an agent reads it as an empty answer
            return "lost", "empty success (finish_reason abort, no output)"
        return "clean", "finish_reason abort"
    return "ok", "200"


def classify_sse(data: bytes) -> tuple[str, str]:
    done = err = aborted = text = False
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            if done:
                return "lost", "event after [DONE]"
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return "lost", "malformed SSE event"
            if isinstance(obj, dict) and "error" in obj:
                err = True
                continue
            if isinstance(obj, dict) and _aborted(obj):
                aborted = True
            text = text or (isinstance(obj, dict) and _has_text(obj))
    if not done:
        return "lost", "stream ended without [DONE]" + (" (after an error event)" if err else "")
    if err:
        return "clean", "stream error event"
    if aborted and not text:  # an agent reads it as an empty answer
        return "lost", "empty success (stream finish_reason abort, no output)"
    if aborted:
        return "clean", "stream finish_reason abort"
    return "ok", "200 stream"


async def request_outcome(
    client: httpx.AsyncClient, path: str, body: dict, deadline_s: float
) -> tuple[str, str]:
    """Send one request and classify what came back (see the module docstring)."""

    async def go() -> tuple[str, str]:
        async with client.stream("POST", path, content=orjson.dumps(body), headers=_JSON_HDR) as r:
            data = await r.aread()
            if r.status_code != 200:
                return classify_error(r.status_code, data)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                return classify_sse(data)
            if body.get("stream"):
                return "lost", "stream requested, no event stream returned"
            return classify_json(data)

    try:
        return await asyncio.wait_for(go(), deadline_s)
    except (asyncio.TimeoutError, TimeoutError):
        return "lost", f"no answer within {deadline_s:g} s"
    except httpx.HTTPError as e:
        return "lost", f"{type(e).__name__} without an error event"


_JSON_HDR = {"content-type": "application/json"}


# -- counting --------------------------------------------------------------------------------------
@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    clean: int = 0
    lost: int = 0
    reasons: Counter = field(default_factory=Counter)

    def add(self, kind: str, reason: str) -> None:
        self.sent += 1
        setattr(self, kind, getattr(self, kind) + 1)
        self.reasons[f"{kind}: {reason}"] += 1

    def merge(self, other: Counts) -> None:
        for k in ("sent", "ok", "clean", "lost"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.reasons.update(other.reasons)

    def row(self) -> str:
        return f"sent={self.sent} ok={self.ok} clean_error={self.clean} lost={self.lost}"


def make_bodies(
    n: int, seed: int = 0, max_tokens: int = 16, shared_prefix: int = 0
) -> list[tuple[str, dict]]:
    """``n`` requests over the three generation endpoints, every other one streamed.

    ``shared_prefix``: the ``/generate`` requests (``input_ids``) share that many leading tokens,
    so the global tier has something to find.
    """
    out = []
    prefix = [(7 * i + 3) % 30000 + 1 for i in range(shared_prefix)]
    for i in range(n):
        k = seed * 100_000 + i
        stream = i % 2 == 1
        kind = i % 3
        words = f"request {k}: refactor module_{k % 17}.py and explain the change. " * 8
        if kind == 0:
            body = {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": words},
                ],
                "max_tokens": max_tokens,
                "stream": stream,
            }
            out.append(("/v1/chat/completions", body))
        elif kind == 1:
            out.append(
                (
                    "/v1/completions",
                    {"prompt": words, "max_tokens": max_tokens, "stream": stream},
                )
            )
        else:
            ids = prefix + [(k * 131 + j * 17) % 30000 + 1 for j in range(200)]
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
                "stream": stream,
            }
            out.append(("/generate", body))
    return out


async def drive(
    base_url: str,
    bodies: list[tuple[str, dict]],
    concurrency: int,
    deadline_s: float,
    at: dict[int, Callable[[], Awaitable[None]]] | None = None,
) -> tuple[Counts, list[asyncio.Task]]:
    """Send ``bodies`` with at most ``concurrency`` in flight; ``at[i]`` starts (as a task) when
    request ``i`` is sent. Returns the counts and the fault tasks (awaited by the caller)."""
    counts = Counts()
    sem = asyncio.Semaphore(concurrency)
    tasks: list[asyncio.Task] = []
    at = at or {}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(deadline_s + 5, connect=10)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def one(i: int, path: str, body: dict) -> None:
            async with sem:
                if i in at:
                    tasks.append(asyncio.create_task(at[i]()))
                kind, reason = await request_outcome(client, path, body, deadline_s)
                counts.add(kind, reason)

        await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(bodies)))
    return counts, tasks


# -- the stack ------------------------------------------------------------------------------------
@dataclass
class WorkerSpec:
    mode: str
    name: str
    port: int
    bootstrap_port: int | None = None
    kv_events: str | None = None
    flags: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class FaultStack:
    """mooncake_master (optional), emulated prefill/decode workers and the router, as processes.

    Workers can be killed and restarted on the same ports; the router is read through its admin
    API and ``/metrics``.
    """

    def __init__(
        self,
        log_dir: str | Path,
        n_prefill: int = 2,
        n_decode: int = 1,
        mooncake: bool = False,
        router: dict | None = None,
        worker_flags: dict | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.procs = Procs(self.log_dir)
        self.token = "faults-admin-token"
        self.master: Master | None = None
        self.mooncake = mooncake
        self.router_over = router or {}
        self.flags = {
            "page_size": PAGE,
            # a prefill of ~250 tokens takes ~0.2 s and a decode of 16 tokens ~0.5 s, so a fault
            # finds requests in every phase
            "time_factor": 20.0,
            "decode_tpot_s": 0.0015,
            "kv_transport": "http",
            "bootstrap_timeout_s": 20,
            "capacity_tokens": 200_000,
            **(worker_flags or {}),
        }
        self.prefill = [
            WorkerSpec("prefill", f"prefill-{i}", free_port(), free_port(), f"tcp://127.0.0.1:{free_port()}")
            for i in range(n_prefill)
        ]
        self.decode = [WorkerSpec("decode", f"decode-{i}", free_port()) for i in range(n_decode)]
        self.router_port = free_port()
        self.router_proc: subprocess.Popen | None = None
        self.http = httpx.Client(timeout=httpx.Timeout(30, connect=5))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> FaultStack:
        self.procs.__enter__()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.mooncake:
            self.master = self.procs.master()
        for w in self.prefill + self.decode:
            self.start_worker(w)
        self.start_router()

    def close(self) -> None:
        self.http.close()
        self.procs.stop_all()

    def start_worker(self, w: WorkerSpec, timeout: float = 60.0) -> None:
        argv = [sys.executable, "-m", "stack.cli", "worker", "--emulate", "--mode", w.mode]
        argv += ["--port", str(w.port), "--name", w.name, "--log-level", "warning", "--fault-control"]
        if w.bootstrap_port:
            argv += ["--bootstrap-port", str(w.bootstrap_port)]
        if w.kv_events:
            argv += ["--kv-events-endpoint", w.kv_events]
        if self.master is not None and w.mode == "prefill":
            argv += [
                "--mooncake-master",
                self.master.address,
                "--mooncake-metadata",
                self.master.metadata_url,
            ]
        for k, v in {**self.flags, **w.flags}.items():
            if v is not None:
                argv += [f"--{k.replace('_', '-')}", str(v)]
        w.proc, log = self.procs._spawn(argv, f"{w.name}-{len(self.procs.procs)}")
        wait_worker(w.url, w.name, w.mode, timeout, w.proc, log)

    def router_config(self) -> dict:
        rc = {
            "host": "127.0.0.1",
            "port": self.router_port,
            "policy": "smetric",
            "log_level": "info",
            "health_interval_s": 0.5,
            "health_timeout_s": 1.0,
            "health_failures": 2,
            "eject_cooldown_s": 1.0,
            "request_timeout_s": 20,
            "connect_timeout_s": 2,
            "admin_token_env": ADMIN_ENV,
            "global_tier": "mooncake" if self.master is not None else "written",
            **self.router_over,
        }
        cfg = {
            "model": {"name": "m", "page_size": PAGE, "context_length": 65536},
            "router": rc,
            "prefill": [
                {"url": w.url, "bootstrap_port": w.bootstrap_port, "kv_events": w.kv_events}
                for w in self.prefill
            ],
            "decode": [{"url": w.url} for w in self.decode],
        }
        if self.master is not None:
            cfg["mooncake"] = {"master": self.master.address, "metadata_url": self.master.metadata_url}
        return cfg

    def start_router(self, timeout: float = 60.0) -> None:
        path = self.log_dir / "router.yaml"
        path.write_text(yaml.safe_dump(self.router_config()))
        argv = [sys.executable, "-m", "stack.cli", "router", "--config", str(path)]
        self.router_proc, log = self.procs._spawn(argv, "router", env={ADMIN_ENV: self.token})
        wait_http(self.url + "/health", timeout, self.router_proc, log)

    @property
    def router_log(self) -> Path:
        return self.log_dir / "router.log"

    def kill(self, w: WorkerSpec, sig: int = signal.SIGKILL) -> None:
        assert w.proc is not None
        os.killpg(w.proc.pid, sig)
        w.proc.wait(10)

    def set_fault(self, w: WorkerSpec, fault: str | None, delay_s: float | None = None) -> None:
        r = self.http.post(w.url + "/debug/fault", json={"fault": fault, "delay_s": delay_s})
        r.raise_for_status()

    # -- the router's view ----------------------------------------------------------------------
    def admin_workers(self) -> list[dict]:
        r = self.http.get(self.url + "/admin/workers", headers={"Authorization": f"Bearer {self.token}"})
        r.raise_for_status()
        return r.json()["workers"]

    def healthy(self, w: WorkerSpec) -> bool:
        for x in self.admin_workers():
            if x["url"] == w.url and x["role"] == w.mode:
                return bool(x["healthy"])
        raise KeyError(w.url)

    def dispatched(self, w: WorkerSpec) -> int:
        for x in self.admin_workers():
            if x["url"] == w.url and x["role"] == w.mode:
                return int(x["dispatched"])
        raise KeyError(w.url)

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.http.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                rest = line[len(name) :]
                if rest[:1] in (" ", "{"):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    async def wait_until(self, cond: Callable[[], bool], timeout: float, step: float = 0.1) -> float | None:
        """Seconds until ``cond()`` held (polled off the event loop), or None on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if await asyncio.to_thread(cond):
                return time.monotonic() - t0
            await asyncio.sleep(step)
        return None
