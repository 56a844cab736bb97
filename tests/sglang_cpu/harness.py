"""Start/stop real SGLang CPU workers from ProcessSpecs (test-only helper for the `sglang` tier).

Each process runs in its own process group; `stop()` signals that group only (SGLang forks a
scheduler and a detokenizer), never anything by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from stack.launch.spec import ProcessSpec, expand_secrets

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"


class Proc:
    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen, log: Path):
        self.spec, self.popen, self.log = spec, popen, log

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(5)


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every group at once, then wait (SGLang drains for a few seconds on SIGTERM)."""
    live = [p for p in procs if p is not None and p.alive()]
    for p in live:
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.stop(timeout=1.0)


def start(spec: ProcessSpec, logdir: Path, extra_env: dict[str, str] | None = None) -> Proc:
    env = dict(os.environ)
    env.update(spec.env)
    # test-only stand-ins (sgl_kernel, HiCache CPU patch) for SGLang workers only
    if spec.role in ("prefill", "decode", "single"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH", "")) if p)
    env.update(extra_env or {})
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{spec.name}.log"
    fh = open(log, "wb")
    argv = expand_secrets(spec, env)  # $(NAME) of spec.secret_env: e.g. the workers' API keys
    p = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    fh.close()
    return Proc(spec, p, log)


def wait_ready(procs: list[Proc], timeout: float = 240.0) -> None:
    """Wait until every process answers its ready URL (or TCP port); raise with its log if not."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.spec.name} exited with {p.popen.returncode}:\n{p.tail()}")
            if _ready(p.spec):
                pending.remove(p)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"not ready after {timeout:.0f} s: {[p.spec.name for p in pending]}\n{pending[0].tail()}"
            )
        time.sleep(1.0)


def _ready(spec: ProcessSpec) -> bool:
    if spec.ready_url:
        try:
            with urllib.request.urlopen(spec.ready_url, timeout=3) as r:
                return r.status == 200
        except Exception:
            return False
    if spec.ready_port:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((spec.host, spec.ready_port)) == 0
    return True


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
