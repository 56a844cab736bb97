"""A rolling upgrade under load, with no failed request: two router replicas (``smetric router``
processes sharing a real Redis) behind a real haproxy that health-checks them, clients of the
official OpenAI and Anthropic SDKs (streamed and not, their default retries) sending all along,
while each replica in turn is stopped with SIGTERM (it drains: docs/router.md) and started
again, and then a prefill worker is drained and added back through the admin API."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
import yaml

from stack.models.tiny import build_tiny_model
from stack.ports import free_port
from stack.worker.fake import FakeWorker, KVLink, ServerThread
from support.haproxy import HAProxy

pytestmark = pytest.mark.timeout(180)

TOKEN = "rolling-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MSG = [{"role": "user", "content": "roll on"}]


class Replica:
    """``smetric router --replica-id rid`` on ``port`` (restartable on the same port)."""

    def __init__(self, cfg_path, port: int, rid: str, log_dir) -> None:
        self.cfg_path, self.port, self.rid, self.log_dir = cfg_path, port, rid, log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"{self.rid}-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", "router", "--config", str(self.cfg_path)]
            + ["--port", str(self.port), "--replica-id", self.rid],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", SMETRIC_ROLLING_ADMIN=TOKEN),
        )
        log.close()
        _wait(lambda: self._healthy(), 60, f"{self.rid} did not come up")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"{self.rid} exited {self.proc.returncode}"
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        """SIGTERM, then its exit code once it has drained."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _wait(cond, timeout: float, what: str = "condition not met") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)


class Traffic:
    """Client threads calling through ``url`` until stopped; every call's outcome kept."""

    def __init__(self, url: str, n: int = 3) -> None:
        self.url = url
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        oa = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=30)  # SDK retries: 2
        an = anthropic.Anthropic(base_url=self.url, api_key="unused", timeout=30)
        kinds = [self._chat, self._chat_stream, self._messages, self._messages_stream]
        with oa, an:
            while not self.stop.is_set():
                call = rng.choice(kinds)
                try:
                    assert call(oa, an), f"{call.__name__}: empty answer"
                    with self.lock:
                        self.ok += 1
                except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                    with self.lock:
                        self.failed.append(f"{call.__name__}: {type(e).__name__}: {e}"[:300])

    @staticmethod
    def _chat(oa, an) -> str:
        r = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
        return r.choices[0].message.content

    @staticmethod
    def _chat_stream(oa, an) -> str:
        s = oa.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

    @staticmethod
    def _messages(oa, an) -> str:
        return an.messages.create(model="tiny", max_tokens=4, messages=MSG).content[0].text

    @staticmethod
    def _messages_stream(oa, an) -> str:
        with an.messages.stream(model="tiny", max_tokens=4, messages=MSG) as s:
            return "".join(s.text_stream)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_a_rolling_upgrade_under_load_fails_no_request(tmp_path, redis_server):
    link = KVLink()
    kw = {"link": link, "agent_paths": True}
    prefill = [FakeWorker(mode="prefill", name=f"p{i}", prefill_delay_s=0.2, **kw) for i in range(2)]
    decode = FakeWorker(mode="decode", name="d0", tokens=4, chunk_delay_s=0.05, **kw)
    servers = [ServerThread(w).start() for w in [*prefill, decode]]
    cfg = {
        "model": {
            "name": "tiny",
            "path": str(build_tiny_model(tmp_path / "tiny")),
            "page_size": 16,
            "context_length": 4096,
        },
        "router": {
            "redis_url": redis_server.url,
            "admin_token_env": "SMETRIC_ROLLING_ADMIN",
            "drain_notice_s": 1.0,  # haproxy's checks (every 200 ms) see the 503 well before
            "retry_after_s": 1,
            "health_interval_s": 0.5,
            "health_timeout_s": 5.0,
            "log_level": "warning",
        },
        "prefill": [{"url": s.url, "bootstrap_port": 9300 + i} for i, s in enumerate(servers[:2])],
        "decode": [{"url": servers[2].url}],
    }
    cfg_path = tmp_path / "router.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    replicas = [Replica(cfg_path, free_port(), f"r{i}", tmp_path) for i in range(2)]
    px = traffic = None
    try:
        for r in replicas:
            r.start()
        px = HAProxy([r.url for r in replicas], tmp_path, check=True)
        traffic = Traffic(px.url)
        time.sleep(2.0)
        for r in replicas:  # one after the other: stop (it drains), start again
            before = traffic.ok
            assert r.stop() == 0, (tmp_path / f"{r.rid}-{r.starts}.log").read_text()
            r.start()
            _wait(lambda before=before: traffic.ok >= before + 5, 30, "no traffic got through")
        # a prefill worker drained, then added back (through one replica; both follow)
        p0 = servers[0].url
        rr = httpx.post(
            replicas[0].url + "/admin/workers/drain", json={"url": p0, "role": "prefill"}, headers=AUTH
        )
        assert rr.status_code == 202, rr.text

        def listed(r: Replica) -> bool:
            ws = httpx.get(r.url + "/admin/workers", headers=AUTH, timeout=5).json()["workers"]
            return any(w["url"] == p0 for w in ws)

        _wait(lambda: not any(listed(r) for r in replicas), 30, "the drained worker was not removed")
        n_p0 = len(prefill[0].records)
        time.sleep(1.0)
        assert len(prefill[0].records) == n_p0  # out of the pool: no request reached it
        rr = httpx.post(
            replicas[1].url + "/admin/workers", json={"url": p0, "bootstrap_port": 9300}, headers=AUTH
        )
        assert rr.status_code == 201, rr.text
        _wait(lambda: all(listed(r) for r in replicas), 10, "the worker was not added back everywhere")
        _wait(lambda: len(prefill[0].records) > n_p0, 30, "the re-added worker got no request")
        traffic.finish()
        assert not traffic.failed, traffic.failed[:5]
        assert traffic.ok >= 30, traffic.ok
        print(f"rolling upgrade: {traffic.ok} calls, none failed")
    finally:
        if traffic is not None:
            traffic.finish()
        if px is not None:
            px.close()
        for r in replicas:
            r.kill()
        for s in servers:
            s.stop()
