"""Fault injection against a live local PD stack, counting what became of every request.

Each scenario starts real processes on loopback (emulated SGLang workers, the ``smetric router``
command, a real ``mooncake_master`` where it matters), drives a fixed number of requests at a
fixed concurrency (chat, completions and ``/generate``, half of them streamed), injects one fault
part-way through, and classifies every request:

- **ok**: 200 and a well-formed answer: one JSON object, or SSE events that all parse as JSON and
  end with ``data: [DONE]``;
- **clean error**: the client was told, in a form an OpenAI client understands: a 4xx/5xx whose
  body is an OpenAI-shaped JSON error, an SSE stream that carries an error event (or a
  ``finish_reason`` of ``abort``) and still ends with ``[DONE]``, or a 200 whose
  ``finish_reason`` is ``abort``;
- **lost**: anything else: no answer within the deadline (a hang), a connection reset, a stream
  cut without an error event, a malformed body passed through, a 5xx without a JSON error.

A scenario passes when nothing is lost and the router's view matches the fault (the killed
worker is ejected, then readmitted once it is back). Used by ``tests/test_faults.py``
(``pytest -m faults``) and as a script that prints the table in ``docs/faults.md``::

    python -m stack.faults                       # every scenario
    python -m stack.faults --only decode_killed --requests 300 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

from stack.launch.loopback import Master, Procs, mooncake_skip_reason, wait_http, wait_worker
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
        return "clean", "finish_reason abort"
    return "ok", "200"


def classify_sse(data: bytes) -> tuple[str, str]:
    done = err = aborted = False
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
            elif isinstance(obj, dict) and _aborted(obj):
                aborted = True
    if not done:
        return "lost", "stream ended without [DONE]" + (" (after an error event)" if err else "")
    if err:
        return "clean", "stream error event"
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
                    {"model": "m", "prompt": words, "max_tokens": max_tokens, "stream": stream},
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


# -- scenarios ------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    fault: str
    counts: Counts
    checks: dict = field(default_factory=dict)  # name -> bool
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.counts.lost == 0 and all(self.checks.values())


def _run(coro):
    return asyncio.run(coro)


def _kill_and_restart(
    stack: FaultStack, w: WorkerSpec, res: Result, down_s: float = 1.0, delay_s: float = 0.0
):
    async def action() -> None:
        await asyncio.sleep(delay_s)
        t0 = time.monotonic()
        await asyncio.to_thread(stack.kill, w)
        ejected = await stack.wait_until(lambda: not stack.healthy(w), 15)
        res.checks["ejected"] = ejected is not None
        if ejected is not None:
            res.notes.append(f"ejected {time.monotonic() - t0:.1f} s after the kill")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(stack.start_worker, w)
        t1 = time.monotonic()
        back = await stack.wait_until(lambda: stack.healthy(w), 20)
        res.checks["readmitted"] = back is not None
        if back is not None:
            res.notes.append(f"readmitted {time.monotonic() - t1:.1f} s after the restart")

    return action


def _after(stack: FaultStack, res: Result, w: WorkerSpec | None, n: int, concurrency: int, deadline: float):
    """A batch after the fault is over: everything must succeed (and reach ``w`` again)."""
    before = stack.dispatched(w) if w is not None else 0
    counts, _ = _run(drive(stack.url, make_bodies(n, seed=9), concurrency, deadline))
    res.checks["all ok afterwards"] = counts.ok == counts.sent
    if w is not None:
        res.checks[f"{w.name} serves again"] = stack.dispatched(w) > before
    res.notes.append(f"afterwards: {counts.row()}")
    res.counts.merge(counts)


def prefill_killed(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """SIGKILL a prefill worker under load; restart it on the same ports."""
    res = Result("prefill_killed", "SIGKILL one of 2 prefill workers under load, restart it", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=1) as s:
        w = s.prefill[0]
        counts, tasks = _run(_drive_with(s, n, concurrency, deadline, {n // 3: _kill_and_restart(s, w, res)}))
        res.counts = counts
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        _after(s, res, w, 20, concurrency, deadline)
    return res


def decode_killed(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    res = Result("decode_killed", "SIGKILL one of 2 decode workers under load, restart it", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=2) as s:
        w = s.decode[0]
        # longer answers (64 tokens, ~2 s of streaming), and four streams of 300 tokens (~9 s)
        # sent just before the kill: it finds streams mid-way on both decode workers
        bodies = make_bodies(n, max_tokens=64)
        k = n // 3
        for j in range(4):
            ids = [(j * 977 + i * 13) % 30000 + 1 for i in range(200)]
            sp = {"max_new_tokens": 300, "ignore_eos": True}
            bodies[k - 4 + j] = ("/generate", {"input_ids": ids, "sampling_params": sp, "stream": True})
        at = {k: _kill_and_restart(s, w, res, delay_s=1.5)}
        counts, _ = _run(_drive_bodies(s, bodies, concurrency, deadline, at))
        res.counts = counts
        cut = counts.reasons.get("clean: stream error event", 0)
        res.checks["streams cut mid-way end with an error event"] = cut >= 1
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        _after(s, res, w, 20, concurrency, deadline)
    return res


def mooncake_master_stopped(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """Stop mooncake_master under load: global-tier lookups miss, serving goes on."""
    res = Result("mooncake_master_stopped", "SIGKILL mooncake_master under load (not restarted)", Counts())
    why = mooncake_skip_reason()
    if why is not None:
        res.checks["mooncake available"] = False
        res.notes.append(why)
        return res
    with FaultStack(log_dir, n_prefill=2, n_decode=1, mooncake=True) as s:
        marks: dict = {}

        async def stop_master() -> None:
            marks["global_before"] = await asyncio.to_thread(s.metric, "smetric_global_hit_tokens_total")
            assert s.master is not None
            await asyncio.to_thread(
                lambda: (os.killpg(s.master.proc.pid, signal.SIGKILL), s.master.proc.wait(10))
            )
            await asyncio.sleep(2.0)  # the router's existence cache lives 1 s
            marks["global_after_stop"] = await asyncio.to_thread(s.metric, "smetric_global_hit_tokens_total")

        bodies = make_bodies(n, shared_prefix=20 * PAGE)
        counts, tasks = _run(_drive_bodies(s, bodies, concurrency, deadline, {n // 3: stop_master}))
        res.counts = counts
        end = s.metric("smetric_global_hit_tokens_total")
        res.checks["global hits before the stop"] = marks.get("global_before", 0) > 0
        res.checks["no global hits after the stop"] = end == marks.get("global_after_stop", -1)
        res.notes.append(
            f"global-hit tokens: {marks.get('global_before', 0):g} before the stop, "
            f"+{end - marks.get('global_after_stop', end):g} after it"
        )
        _after(s, res, None, 20, concurrency, deadline)
    return res


def slow_worker(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A prefill worker that answers everything (health included) 30 s late; the router's request
    timeout is 8 s."""
    res = Result(
        "slow_worker", "a prefill worker answers every call 30 s late (router timeout 8 s)", Counts()
    )
    with FaultStack(log_dir, n_prefill=2, n_decode=1, router={"request_timeout_s": 8}) as s:
        w = s.prefill[0]

        async def slow() -> None:
            await asyncio.to_thread(s.set_fault, w, "slow", 30.0)
            t = await s.wait_until(lambda: not s.healthy(w), 15)
            res.checks["ejected"] = t is not None
            if t is not None:
                res.notes.append(f"ejected {t:.1f} s after slowing down")

        counts, _ = _run(_drive_with(s, n, concurrency, deadline, {n // 4: slow}))
        res.counts = counts
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        # heal it: readmitted
        s.set_fault(w, None)
        res.checks["readmitted"] = _run(s.wait_until(lambda: s.healthy(w), 40)) is not None
        _after(s, res, w, 20, concurrency, deadline)
    return res


def malformed_worker(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A decode worker answers 200 with broken JSON bodies and broken SSE streams (its /health is
    fine, its /v1/loads is nonsense)."""
    res = Result("malformed_worker", "a decode worker answers 200 with malformed bodies/streams", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=2) as s:
        w = s.decode[0]

        async def bad() -> None:
            await asyncio.to_thread(s.set_fault, w, "malformed")

        counts, _ = _run(_drive_with(s, n, concurrency, deadline, {n // 4: bad}))
        res.counts = counts
        retries, ejections = s.metric("smetric_retries_total"), s.metric("smetric_ejections_total")
        res.notes.append(f"retries={retries:g}, ejections={ejections:g}")
        s.set_fault(w, None)
        res.checks["healthy once fixed"] = _run(s.wait_until(lambda: s.healthy(w), 20)) is not None
        _after(s, res, w, 20, concurrency, deadline)
        res.checks["router alive"] = s.router_proc is not None and s.router_proc.poll() is None
    return res


async def _drive_with(
    s: FaultStack, n: int, concurrency: int, deadline: float, at: dict, max_tokens: int = 16
) -> tuple[Counts, list]:
    return await _drive_bodies(s, make_bodies(n, max_tokens=max_tokens), concurrency, deadline, at)


async def _drive_bodies(
    s: FaultStack, bodies, concurrency: int, deadline: float, at: dict
) -> tuple[Counts, list]:
    counts, tasks = await drive(s.url, bodies, concurrency, deadline, at)
    for t in tasks:
        await t  # the fault's own checks (ejection, readmission) finish
    return counts, tasks


SCENARIOS: dict[str, Callable[..., Result]] = {
    "prefill_killed": prefill_killed,
    "decode_killed": decode_killed,
    "mooncake_master_stopped": mooncake_master_stopped,
    "slow_worker": slow_worker,
    "malformed_worker": malformed_worker,
}


def table(results: list[Result]) -> str:
    lines = [
        "| fault | sent | succeeded | clean error | lost | checks |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        checks = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r.checks.items())
        c = r.counts
        lines.append(f"| {r.fault} | {c.sent} | {c.ok} | {c.clean} | {c.lost} | {checks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fault-injection scenarios against a local PD stack")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these (repeatable)")
    ap.add_argument(
        "--requests", type=int, default=200, help="requests per scenario (before the after-batch)"
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--deadline", type=float, default=60.0, help="seconds after which a request counts as hung"
    )
    ap.add_argument("--log-dir", default=None, help="keep process logs here (default: a temp dir)")
    a = ap.parse_args(argv)
    base = Path(a.log_dir or tempfile.mkdtemp(prefix="smetric-faults-"))
    results = []
    for name in a.only or list(SCENARIOS):
        t0 = time.monotonic()
        r = SCENARIOS[name](base / name, n=a.requests, concurrency=a.concurrency, deadline=a.deadline)
        results.append(r)
        print(f"{name}: {r.counts.row()} checks={r.checks} ({time.monotonic() - t0:.0f} s)", flush=True)
        for reason, k in sorted(r.counts.reasons.items()):
            print(f"    {k:5d}  {reason}")
        for note in r.notes:
            print(f"    {note}")
    print()
    print(table(results))
    print(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {base}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
