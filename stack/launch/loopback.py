"""Processes on free loopback ports: a real ``mooncake_master`` and emulated workers as
subprocesses, owned by one ``Procs`` that stops them all.

Used by the fault harness (``stack.faults``) and by tests/*/test_worker_*.py,
tests/*/test_mooncake_*.py and tests/*/test_launch_*.py::

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

from stack.kv_tier.mooncake_store import mooncake_available
from stack.ports import free_port
from stack.worker.settings import disaggregation_mode


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


def wait_worker(
    url: str,
    name: str,
    mode: str,
    timeout: float = 60.0,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    """:func:`wait_http` on an emulated worker's ``/health``, then a check that the server on
    ``url`` is that worker (its ``/server_info`` name and mode): another server on the same
    port would pass ``/health`` too (a prefill worker's bootstrap server answers it)."""
    wait_http(url + "/health", timeout, proc, log)
    try:
        info = client().get(url + "/server_info", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        info = {}
    if not isinstance(info, dict):
        info = {}
    emu = info.get("emulator")
    got = emu.get("name") if isinstance(emu, dict) else None
    if got != name or info.get("disaggregation_mode") != mode:
        raise RuntimeError(f"{url} is answered by {got!r}, not the {mode} worker {name}")


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


_WORKER = [sys.executable, "-m", "stack.cli", "worker", "--emulate"]


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
    proc: subprocess.Popen | None  # a pool's members share one
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
        w, argv = self._member(mode, mooncake, kv_events, **flags)
        p, log = self._spawn([*_WORKER, *argv], w.name)
        w.proc = p
        wait_worker(w.url, w.name, disaggregation_mode(mode), timeout, p, log)
        return w

    def pool(
        self, members: list[dict], mooncake: Master | None = None, timeout: float = 60.0, name: str = "pool"
    ) -> list[WorkerProc]:
        """Several emulated workers in one process (``smetric worker --pool``): each member a
        dict of :meth:`worker`'s arguments (``mode``, ``kv_events``, flags)."""
        import json

        made = [self._member(mooncake=mooncake, **dict(m)) for m in members]
        p, log = self._spawn([*_WORKER, "--pool", json.dumps([a for _, a in made])], name)
        for w, _ in made:
            w.proc = p
            wait_worker(w.url, w.name, disaggregation_mode(w.mode), timeout, p, log)
        return [w for w, _ in made]

    def _member(
        self, mode: str, mooncake: Master | None = None, kv_events: bool = False, **flags
    ) -> tuple[WorkerProc, list[str]]:
        port = free_port()
        name = flags.pop("name", f"{mode}-{port}")
        argv = ["--mode", mode, "--port", str(port), "--name", name]
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
            if v is None or v is False:
                continue
            if v is True:  # a switch (e.g. enable_priority_scheduling=True)
                argv.append(f"--{k.replace('_', '-')}")
                continue
            argv += [f"--{k.replace('_', '-')}", str(v)]
        return WorkerProc(mode, port, None, bport, ev, name), argv

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


_CLIENT: httpx.Client | None = None


def client() -> httpx.Client:
    """A shared HTTP client (``httpx.get`` builds an SSL context per call: ~30 ms)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=httpx.Timeout(120, connect=5))
    return _CLIENT
