"""A real haproxy (Debian's package, `.ci/install-system.sh`) on a free loopback port, in front
of router URLs: the proxy between clients and the router that deployments put there."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from stack.ports import free_port


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if path is None:
        raise RuntimeError("haproxy is not installed (bash .ci/install-system.sh apt-installs it)")
    return path


class HAProxy:
    """haproxy in HTTP mode over ``backends`` (router base URLs), round robin.

    ``idle_s``: its client and server idle timeouts. ``check``: health checks of each
    backend's ``/health`` every 200 ms (down after one failure, up after two passes), with a
    connection failure retried on another backend (``option redispatch``)."""

    def __init__(
        self, backends: list[str], tmp_path: Path, idle_s: float = 30.0, check: bool = False
    ) -> None:
        self.port = free_port()
        servers = []
        for i, url in enumerate(backends):
            hp = url.removeprefix("http://")
            servers.append(f"  server r{i} {hp}" + (" check inter 200ms fall 1 rise 2" if check else ""))
        lines = [
            "defaults",
            "  mode http",
            "  timeout connect 2s",
            f"  timeout client {int(idle_s * 1000)}ms",
            f"  timeout server {int(idle_s * 1000)}ms",
            "  retries 3",
            "  option redispatch",
            "frontend f",
            f"  bind 127.0.0.1:{self.port}",
            "  default_backend b",
            "backend b",
            "  balance roundrobin",
            *(["  option httpchk GET /health", "  http-check expect status 200"] if check else []),
            *servers,
        ]
        self.cfg = tmp_path / f"haproxy-{self.port}.cfg"
        self.cfg.write_text("\n".join(lines) + "\n")
        self.log = tmp_path / f"haproxy-{self.port}.log"
        self._out = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(self.cfg)], stdout=self._out, stderr=subprocess.STDOUT
        )
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() - t0 < 10, "haproxy did not start"
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._out.close()
