"""A real ``redis-server`` on a free loopback port (no persistence, no config file), which a
test or a benchmark can stop and restart on the same port.

Used by tests/integration/test_router_replicas.py and benchmarks/replicas.py. redis-server comes from
``.ci/install-system.sh`` (apt ``redis-server``); without it :func:`require_redis_server`
fails loudly rather than letting the replica tests skip.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from stack.ports import free_port


def require_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server is not on PATH: the router-replica tests need a real Redis "
            "(run `bash .ci/install-system.sh`, which apt-installs redis-server)"
        )
    return path


class RedisServer:
    def __init__(self, log_dir: Path | str | None = None, port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.port = port or free_port()
        self.log = Path(log_dir) / f"redis-{self.port}.log" if log_dir else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}) on port {self.port}")
            if self.ping():
                return self
            time.sleep(0.02)
        raise TimeoutError(f"redis-server not answering on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # abrupt, as a crash; with --save "" nothing survives
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
