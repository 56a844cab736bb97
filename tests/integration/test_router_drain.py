"""A router replica that drains (stack/prefill_router/drain.py): on SIGTERM `/health` answers
503 draining at once, new requests get their API's overload answer, the stream in flight runs
to its end, and then the process exits by itself; `POST /admin/drain` stops intake without
stopping the process, `DELETE` resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml

from stack.models.tiny import build_tiny_model
from stack.ports import free_port
from stack.worker.fake import FakeWorker, ServerThread

pytestmark = pytest.mark.timeout(90)

TOKEN = "drain-admin-token"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


class Router:
    """`smetric router` in a process of its own, in front of a fake PD pair whose decode
    streams 20 tokens 0.1 s apart."""

    def __init__(self, tmp_path, model_dir) -> None:
        self.p = ServerThread(FakeWorker(mode="prefill", name="p")).start()
        self.d = ServerThread(FakeWorker(mode="decode", name="d", tokens=20, chunk_delay_s=0.1)).start()
        port = free_port()
        cfg = {
            "model": {"name": "tiny", "path": str(model_dir), "page_size": 16, "context_length": 4096},
            "router": {"port": port, "log_level": "warning", "drain_notice_s": 1.0, "retry_after_s": 2},
            "prefill": [{"url": self.p.url, "bootstrap_port": 9001}],
            "decode": [{"url": self.d.url}],
        }
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PYTHONUNBUFFERED="1", SMETRIC_ADMIN_TOKEN=TOKEN)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "router", "--config", str(tmp_path / "r.yaml")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 30, "router did not come up"
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.p.stop()
        self.d.stop()


def _stream(url: str, out: dict, started: threading.Event) -> None:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=30) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data:"):
                chunks.append(line)
                started.set()
    out["chunks"] = chunks


def test_sigterm_drains_then_exits(tmp_path, model_dir):
    rt = Router(tmp_path, model_dir)
    try:
        out: dict = {}
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(rt.url, out, started))
        t.start()
        assert started.wait(10)
        t_term = time.monotonic()
        rt.proc.send_signal(signal.SIGTERM)
        # /health says draining well within one health interval (router.health_interval_s, 2 s)
        while True:
            r = httpx.get(rt.url + "/health", timeout=2)
            if r.status_code == 503:
                break
            assert time.monotonic() - t_term < 1.0, "not draining yet"
            time.sleep(0.02)
        assert r.json()["status"] == "draining" and r.json()["inflight"] == 1
        # a new request gets its API's overload answer, with Retry-After
        r = httpx.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "overloaded"
        r = httpx.post(
            rt.url + "/v1/messages",
            json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            timeout=5,
        )
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        assert rt.proc.poll() is None  # the stream in flight holds the replica
        t.join(20)
        # the stream ran to its end: every token, then [DONE]
        assert out["status"] == 200 and out["chunks"][-1] == "data: [DONE]"
        assert sum('"content"' in c for c in out["chunks"]) >= 20
        rt.proc.wait(timeout=15)  # and then the process exits by itself, cleanly
        assert rt.proc.returncode == 0
        assert time.monotonic() - t_term >= 1.0  # not before drain_notice_s
    finally:
        rt.close()


def test_admin_drain_stops_intake_and_resumes(tmp_path, model_dir):
    rt = Router(tmp_path, model_dir)
    try:
        auth = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.post(rt.url + "/admin/drain", timeout=5).status_code == 401
        r = httpx.post(rt.url + "/admin/drain", headers=auth, timeout=5)
        assert r.status_code == 200 and r.json()["draining"] is True
        assert httpx.get(rt.url + "/health", timeout=5).status_code == 503
        r = httpx.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=5)
        assert r.status_code == 503
        time.sleep(1.5)  # past drain_notice_s: an admin drain does not stop the process
        assert rt.proc.poll() is None
        r = httpx.delete(rt.url + "/admin/drain", headers=auth, timeout=5)
        assert r.status_code == 200 and r.json()["draining"] is False
        assert httpx.get(rt.url + "/health", timeout=5).status_code == 200
        r = httpx.post(rt.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=10)
        assert r.status_code == 200
    finally:
        rt.close()


HANGING_SHUTDOWN = """
import asyncio, sys, time
from contextlib import asynccontextmanager
import uvicorn
from starlette.applications import Starlette
from stack.prefill_router import drain as d

d.EXIT_S = 1.0

@asynccontextmanager
async def lifespan(app):
    yield
    time.sleep(3600)  # a shutdown step that blocks the loop and never returns

port = int(sys.argv[1])
cfg = uvicorn.Config(Starlette(lifespan=lifespan), host="127.0.0.1", port=port, log_level="warning")
print("serving", flush=True)
d.DrainingServer(cfg, d.Drain(), notice_s=0.0, timeout_s=5.0).run()
"""


def test_a_shutdown_that_hangs_after_the_drain_is_cut_short_with_its_stacks_logged(tmp_path):
    """Once drained the process has ``EXIT_S`` to exit: past it, the stacks go to stderr and
    the process exits with status 1 (``smetric down`` never waits on a stuck shutdown)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING_SHUTDOWN, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # up: it answers (404 on /)
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        out = proc.stdout.read().decode()
        assert rc == 1, out
        assert "time.sleep" in out or "lifespan" in out, out  # where it stuck, from the stacks
        assert took < 20, took
    finally:
        if proc.poll() is None:
            proc.kill()
