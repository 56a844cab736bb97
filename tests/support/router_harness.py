"""A loopback test cluster: fake SGLang workers, ZMQ KV-event publishers, and the router."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import httpx

from stack.config import parse_config
from stack.kv_tier.events import encode_batch
from stack.ports import free_port
from stack.worker.fake import FakeWorker, KVLink, ServerThread


@dataclass
class Publisher:
    """A PUB socket publishing SGLang-format KV events (as a worker's publisher does)."""

    endpoint: str
    sock: object
    seq: itertools.count = field(default_factory=itertools.count)

    def send(self, events: list, seq: int | None = None) -> None:
        s = next(self.seq) if seq is None else seq
        self.sock.send_multipart(encode_batch(s, events, time.time(), 0))

    def close(self) -> None:
        self.sock.close(0)


class RouterThread(ServerThread):
    """The router app served in a thread as ``smetric router`` serves it: behind its front door
    (``router.front_door``: head and body limits, connection limit, keep-alive)."""

    def _make(self, port: int) -> None:
        import uvicorn

        self.port = port
        self.config = self.app.state.front_door.server_config(self.app, "127.0.0.1", port, "warning")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)


class WorkerThread(ServerThread):
    """A fake worker served with its own idle keep-alive (uvicorn's default is 5 s)."""

    def __init__(self, app, keep_alive_s: float) -> None:
        self.keep_alive_s = keep_alive_s
        super().__init__(app)

    def _make(self, port: int) -> None:
        import uvicorn

        self.port = port
        self.config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=self.keep_alive_s,  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)


class Cluster:
    def __init__(
        self,
        model_dir,
        n_prefill: int = 2,
        n_decode: int = 1,
        kv_events: bool = False,
        page_size: int = 16,
        policy: str = "smetric",
        router: dict | None = None,
        model: dict | None = None,
        prefill_kw: dict | None = None,
        decode_kw: dict | None = None,
        admin_env: str = "SMETRIC_TEST_ADMIN_TOKEN",
        dead_prefill: int = 0,
        worker_keep_alive_s: float | None = None,
    ) -> None:
        from stack.prefill_router.service import create_app

        pmode = "prefill" if n_decode else "colocated"
        # decode answers once prefill has sent the KV of the same room, as in SGLang
        self.link = KVLink()
        pkw = {"link": self.link, **(prefill_kw or {})}
        dkw = {"link": self.link, **(decode_kw or {})}
        self.prefill = [FakeWorker(mode=pmode, name=f"p{i}", **pkw) for i in range(n_prefill)]
        self.decode = [FakeWorker(mode="decode", name=f"d{i}", **dkw) for i in range(n_decode)]
        if worker_keep_alive_s is None:
            self.servers = [ServerThread(w).start() for w in self.prefill + self.decode]
        else:  # workers that close idle pooled connections sooner
            self.servers = [WorkerThread(w, worker_keep_alive_s).start() for w in self.prefill + self.decode]
        self.publishers: list[Publisher] = []
        if kv_events:
            import zmq

            self.zctx = zmq.Context()
            for _ in range(n_prefill):
                sock = self.zctx.socket(zmq.PUB)
                sock.setsockopt(zmq.LINGER, 0)
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                self.publishers.append(Publisher(f"tcp://127.0.0.1:{port}", sock))
        ps = self.servers[:n_prefill]
        self.dead_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_prefill)]
        prefill_cfg = [
            {
                "url": s.url,
                "bootstrap_port": 9000 + i,
                "kv_events": self.publishers[i].endpoint if kv_events else None,
            }
            for i, s in enumerate(ps)
        ]
        prefill_cfg = [{"url": u, "bootstrap_port": 9100} for u in self.dead_urls] + prefill_cfg
        rc = {
            "policy": policy,
            "health_interval_s": 0.2,
            "health_timeout_s": 0.5,
            "eject_cooldown_s": 2.0,
            "admin_token_env": admin_env,
        }
        rc.update(router or {})
        mc = {
            "name": "tiny",
            "path": str(model_dir) if model_dir else None,
            "page_size": page_size,
            "context_length": 8192,
        }
        mc.update(model or {})
        self.cfg = parse_config(
            {
                "model": mc,
                "router": rc,
                "prefill": prefill_cfg,
                "decode": [{"url": s.url} for s in self.servers[n_prefill:]],
            }
        )
        self.app = create_app(self.cfg)
        self.state = self.app.state.router
        self.router = RouterThread(self.app).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=30)

    @property
    def url(self) -> str:
        return self.router.url

    def worker_by_url(self, url: str):
        for s, w in zip(self.servers, self.prefill + self.decode, strict=True):
            if s.url == url:
                return w
        return None

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Publish empty batches until every subscriber has received one (ZMQ slow joiner)."""
        t0 = time.monotonic()
        subs = self.state.subscribers
        while True:
            pending = [
                i
                for i, w in enumerate(self.prefill_workers())
                if subs.get(w.wid) is None or subs[w.wid].received == 0
            ]
            if not pending:
                return
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("KV event subscribers did not connect")
            for i in pending:
                self.publishers[i].send([])
            time.sleep(0.02)

    def prefill_workers(self):
        return [
            w
            for w in self.state.registry.workers.values()
            if w.role == "prefill" and w.url not in self.dead_urls
        ]

    def wait_for(self, cond, timeout: float = 10.0, step: float = 0.02) -> None:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("condition not met")
            time.sleep(step)

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for s in self.servers:
            s.stop()
        for p in self.publishers:
            p.close()
        if self.publishers:
            self.zctx.term()
