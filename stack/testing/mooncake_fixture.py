"""Test helpers: a real ``mooncake_master`` on free loopback ports, emulated workers as
subprocesses, and a KV-event mirror (a ZMQ subscriber decoding SGLang's wire format).

Used by tests/test_worker_*.py, tests/test_mooncake_*.py and tests/test_launch_*.py::

    with Procs(tmp_path) as procs:
        master = procs.master()
        p0 = procs.worker("prefill", mooncake=master, kv_events=True)
        ...

Every process is stopped (SIGTERM, then SIGKILL) when the ``with`` block ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stack.kv_tier.mooncake_store import free_port, mooncake_available


def mooncake_skip_reason() -> str | None:
    """Why Mooncake tests cannot run here (None: they can)."""
    ok, why = mooncake_available()
    if not ok:
        return why
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH (pip install mooncake-transfer-engine-non-cuda)"
    return None


def wait_http(
    url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} was ready:\n{tail}")
        try:
            if client().get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def wait_port(host: str, port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {host}:{port} was open")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} not open after {timeout} s")


@dataclass
class Master:
    rpc_port: int
    http_port: int
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"


@dataclass
class WorkerProc:
    mode: str
    port: int
    proc: subprocess.Popen
    bootstrap_port: int | None = None
    kv_events: str | None = None
    name: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Procs:
    """Owns every process a test starts; stops them all on exit."""

    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Procs:
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def _spawn(self, argv: list[str], name: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
        log = Path(self.log_dir) / f"{name}.log"
        fh = open(log, "wb")
        e = {**os.environ, "GLOG_minloglevel": "1", **(env or {})}
        p = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=e, start_new_session=True
        )
        fh.close()
        self.procs.append(p)
        return p, log

    def master(self, timeout: float = 30.0) -> Master:
        rpc, http, metrics = free_port(), free_port(), free_port()
        argv = [
            "mooncake_master",
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            f"--metrics_port={metrics}",
            "--metrics_host=127.0.0.1",
            "--rpc_thread_num=2",
        ]
        p, _ = self._spawn(argv, f"mooncake-master-{rpc}")
        wait_port("127.0.0.1", rpc, timeout, p)
        wait_port("127.0.0.1", http, timeout, p)
        return Master(rpc, http, p)

    def worker(
        self,
        mode: str,
        mooncake: Master | None = None,
        kv_events: bool = False,
        timeout: float = 60.0,
        **flags,
    ) -> WorkerProc:
        port = free_port()
        name = flags.pop("name", f"{mode}-{port}")
        argv = [
            sys.executable,
            "-m",
            "stack.cli",
            "worker",
            "--emulate",
            "--mode",
            mode,
            "--port",
            str(port),
            "--name",
            name,
        ]
        bport = None
        ev = None
        if mode == "prefill":
            bport = free_port()
            argv += ["--bootstrap-port", str(bport)]
        if kv_events:
            ev = f"tcp://127.0.0.1:{free_port()}"
            argv += ["--kv-events-endpoint", ev]
        if mooncake is not None:
            argv += ["--mooncake-master", mooncake.address, "--mooncake-metadata", mooncake.metadata_url]
        for k, v in flags.items():
            if v is None:
                continue
            argv += [f"--{k.replace('_', '-')}", str(v)]
        p, log = self._spawn(argv, name)
        w = WorkerProc(mode, port, p, bport, ev, name)
        wait_http(w.url + "/health", timeout, p, log)
        return w

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)

    def stop_all(self, grace: float = 8.0) -> None:
        """SIGTERM every worker at once, wait; then the masters (workers unmount from them)."""
        masters = [
            p for p in self.procs if isinstance(p.args, list) and p.args and p.args[0] == "mooncake_master"
        ]
        others = [p for p in self.procs if p not in masters]
        for group in (others, masters):
            for p in group:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for p in group:
                self.stop(p, grace=0.1)
        self.procs.clear()


class KVMirror:
    """Mirrors an engine's cache from its KV events: a set of block hashes.

    Decodes SGLang's multipart ``[topic, seq, msgpack([ts, events, dp_rank])]`` with events as
    tagged maps (0.5.23) or positional lists (older producers).
    """

    def __init__(self, endpoint: str, topic: str = "kv"):
        import zmq

        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.blocks: dict[int, list[int]] = {}
        self.seq = -1
        self.gaps = 0
        self.messages = 0
        self.events: list[dict] = []

    def close(self) -> None:
        self.sock.close(0)

    def poll(self, timeout_ms: int = 50) -> int:
        import msgpack
        import zmq

        n = 0
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            topic, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.seq >= 0 and seq != self.seq + 1:
                self.gaps += 1
            self.seq = seq
            ts, events, *rest = msgpack.unpackb(payload, raw=False)
            for ev in events:
                self.apply(ev)
            self.messages += 1
            n += 1
            timeout_ms = 0
        return n

    def apply(self, ev) -> None:
        if isinstance(ev, (list, tuple)):  # positional form
            kind = ev[0]
            ev = {
                "type": kind,
                **(
                    {
                        "block_hashes": ev[1],
                        "parent_block_hash": ev[2] if len(ev) > 2 else None,
                        "token_ids": ev[3] if len(ev) > 3 else [],
                        "block_size": ev[4] if len(ev) > 4 else 0,
                    }
                    if kind == "BlockStored"
                    else {"block_hashes": ev[1]}
                    if kind == "BlockRemoved"
                    else {}
                ),
            }
        self.events.append(ev)
        t = ev["type"]
        if t == "BlockStored":
            bs = ev["block_size"]
            toks = ev["token_ids"]
            for i, h in enumerate(ev["block_hashes"]):
                self.blocks[h] = toks[i * bs : (i + 1) * bs]
        elif t == "BlockRemoved":
            for h in ev["block_hashes"]:
                self.blocks.pop(h, None)
        elif t == "AllBlocksCleared":
            self.blocks.clear()

    def sync(self, seq: int, timeout: float = 10.0) -> None:
        """Consume events until ``seq`` (the worker's last published number) is seen."""
        deadline = time.monotonic() + timeout
        while self.seq < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"KV events: at seq {self.seq}, waiting for {seq}")
            self.poll(50)

    def match_pages(self, hashes: list[int], limit: int) -> int:
        k = 0
        while k < min(limit, len(hashes)) and hashes[k] in self.blocks:
            k += 1
        return k


_CLIENT: httpx.Client | None = None


def client() -> httpx.Client:
    """A shared HTTP client (``httpx.get`` builds an SSL context per call: ~30 ms)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=httpx.Timeout(120, connect=5))
    return _CLIENT


def server_seq(url: str) -> int:
    return int(client().get(url + "/server_info").json()["internal_states"][0]["kv_events_seq"])


def subscribe_synced(url: str, endpoint: str, timeout: float = 10.0) -> KVMirror:
    """A mirror connected to a fresh worker, past ZMQ's slow-joiner window: flush the cache
    (an ``AllBlocksCleared`` event) until the mirror receives one."""
    m = KVMirror(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        client().post(url + "/flush_cache")
        time.sleep(0.05)
        if m.poll(100) and any(e["type"] == "AllBlocksCleared" for e in m.events):
            m.sync(server_seq(url))
            return m
        if time.monotonic() > deadline:
            raise TimeoutError("no KV events received from " + endpoint)
