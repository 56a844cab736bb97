"""Free TCP ports for the processes this stack starts on one machine (workers, routers,
mooncake_master, redis-server, bootstrap and KV-event endpoints).

Asking the kernel for port 0 twice can give the same port twice, and a port it hands out that
way lies in the ephemeral range, where any outgoing connection made before the server binds may
take it. Either race starts a server on a port another one already answers, which is hard to
see: a prefill worker's bootstrap server also answers ``/health``, so a second worker that lost
its port looked started and answered 404 to every request. :func:`free_port` therefore picks
ports below the kernel's ephemeral range and never hands out the same port twice in a process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

#: the lowest port handed out (below it: well-known services, and Mooncake's own RPC ports)
LOW = 20000

_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random()


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def port_free(host: str, port: int, reuse_addr: bool = True) -> bool:
    """Whether a server could bind ``port`` on ``host`` now. ``reuse_addr`` (as uvicorn and
    redis-server bind): a port that only closed connections still hold in TIME_WAIT counts as
    free; without it, as :func:`free_port` asks, it does not."""
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing on ``host`` listens on now and that this process has not handed out
    before, outside the ephemeral range when there is room below it."""
    return free_port_run(1, host)


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive such ports (:func:`free_port`; a run for a pool launched
    with ``port_stride: 1``); all ``n`` are marked as given."""

    def take(base: int) -> bool:
        run = range(base, base + n)
        if all(p not in _given and port_free(host, p, reuse_addr=False) for p in run):
            _given.update(run)
            return True
        return False

    high = _ephemeral_low() - 1
    with _lock:
        if high - LOW > 1000 + n:
            for _ in range(200):
                if take(base := _rng.randint(LOW, high - n + 1)):
                    return base
        for _ in range(200):  # no room below the ephemeral range: the kernel's pick, not repeated
            with socket.socket() as s:
                s.bind((host, 0))
                base = s.getsockname()[1]
            if take(base):
                return base
    raise OSError("no free port found" if n == 1 else f"no run of {n} free ports found")
