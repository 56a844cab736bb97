"""Local process manager: start ProcessSpecs, wait for readiness, PID files, stop exactly those.

Every process starts in its own session (process group), logs to ``<run_dir>/logs/<name>.log``
and gets a PID file ``<run_dir>/pids/<name>.json`` holding its pid, process group and kernel
start time (so a recycled pid is never signalled). ``stop_groups`` sends SIGTERM to each group,
waits (cut short by a second Ctrl-C), then SIGKILLs what is left, and removes the PID files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stack.launch.spec import ProcessSpec, expand_secrets


def proc_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[19])  # field 22 of /proc/pid/stat


def proc_alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, started at ``start_time``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    rest = stat.rsplit(")", 1)[1].split()
    if rest[0] in ("Z", "X"):
        return False
    return start_time is None or int(rest[19]) == start_time


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


@dataclass
class Managed:
    spec: ProcessSpec
    pid: int
    pgid: int
    start_time: int | None
    log: str
    popen: subprocess.Popen | None = None
    status: str = "starting"
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None

    def to_json(self) -> dict:
        return {
            "name": self.spec.name,
            "role": self.spec.role,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_time": self.start_time,
            "log": self.log,
            "argv": self.spec.argv,
            "ready_url": self.spec.ready_url,
            "ready_port": self.spec.ready_port,
            "host": self.spec.host,
            "spec": dataclasses.asdict(self.spec),  # what a restart starts (stack.launch.supervise)
        }

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return proc_alive(self.pid, self.start_time)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.pids = self.path / "pids"
        self.logs = self.path / "logs"

    def ensure(self) -> None:
        self.pids.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)

    def records(self) -> list[dict]:
        """PID-file records in start order."""
        if not self.pids.exists():
            return []
        recs = []
        for f in self.pids.glob("*.json"):
            try:
                recs.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(recs, key=lambda r: r.get("seq", 0))

    def live_records(self) -> list[dict]:
        return [r for r in self.records() if proc_alive(int(r["pid"]), r.get("start_time"))]

    def record(self, name: str) -> dict:
        """The record of ``name`` ({} when there is none)."""
        try:
            return json.loads((self.pids / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    @property
    def supervisor_file(self) -> Path:
        """The PID file of the run dir's supervisor process (stack.launch.supervise)."""
        return self.path / "supervisor.json"

    def write(self, m: Managed, seq: int, restarts: int = 0) -> None:
        rec = {**m.to_json(), "seq": seq, "restarts": restarts}
        tmp = self.pids / f".{m.spec.name}.json.tmp"
        tmp.write_text(json.dumps(rec))
        tmp.replace(self.pids / f"{m.spec.name}.json")  # a reader never sees half a record

    def mark_stopping(self, names: list[str]) -> None:
        """Mark records as stopped on purpose: the supervisor restarts none of them."""
        for name in names:
            rec = self.record(name)
            if rec:
                rec["stopping"] = True
                tmp = self.pids / f".{name}.json.tmp"
                tmp.write_text(json.dumps(rec))
                tmp.replace(self.pids / f"{name}.json")

    def remove(self, name: str) -> None:
        try:
            (self.pids / f"{name}.json").unlink()
        except FileNotFoundError:
            pass


def start(spec: ProcessSpec, run: RunDir, seq: int, restarts: int = 0) -> Managed:
    run.ensure()
    for path, text in spec.files.items():  # e.g. a worker's --lmcache-config-file
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    log = run.logs / f"{spec.name}.log"
    env = {**os.environ, **spec.env}
    argv = expand_secrets(spec, env)  # the log shows $(NAME), never a secret
    with open(log, "ab") as fh:
        fh.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} start: {shlex.join(spec.argv)}\n".encode())
        fh.flush()
        p = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            close_fds=True,
            # the launcher blocks the stop signals around a start (no orphan before its PID
            # file); a signal mask survives exec, so the child unblocks them or SIGTERM would
            # never reach it (a router could not drain, a worker not shut down cleanly)
            preexec_fn=_unblock_stop_signals,
        )
    m = Managed(spec, p.pid, p.pid, proc_start_time(p.pid), str(log), popen=p)
    run.write(m, seq, restarts)
    return m


def _unblock_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def probe(spec: ProcessSpec, timeout: float = 1.0) -> bool:
    """One readiness check: the ready URL answers 200, else the ready port accepts (Redis: and
    answers PING)."""
    if spec.ready_url:
        for url in (spec.ready_url, *spec.also_ready):
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    if r.status != 200:
                        return False
            except (urllib.error.URLError, OSError, ValueError):
                return False
        return True
    if spec.ready_port:
        try:
            with socket.create_connection((spec.host, spec.ready_port), timeout=timeout) as s:
                if spec.role == "redis":  # open port is not enough: PING answered
                    return _redis_answers(s, spec, timeout)
                return True
        except OSError:
            return False
    return True


def _redis_answers(sock: socket.socket, spec: ProcessSpec, timeout: float) -> bool:
    """Redis answers PING: PONG, or NOAUTH from one that wants its password first (the routers
    have it; the launcher need not). Over TLS (``--tls-port``) after the handshake, whose
    certificate is the routers' to check, not readiness's."""
    if "--tls-port" in spec.argv:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        sock = ctx.wrap_socket(sock)
    sock.settimeout(timeout)
    sock.sendall(b"PING\r\n")
    return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))


def tail(path: str | Path, n: int = 15) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


@dataclass
class StopResult:
    """What :func:`stop_groups` did: the names that were running, and those of them that did
    not stop on SIGTERM within the grace period (or were hurried) and got SIGKILL."""

    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(
    recs: list[dict],
    run: RunDir | None = None,
    grace_s: float = 10.0,
    hurry: Callable[[], bool] | None = None,
) -> StopResult:
    """SIGTERM every recorded process group (reverse start order), wait up to ``grace_s`` (or
    a process's own longer ``stop_grace_s``: a draining router's), SIGKILL what is left;
    bounded in time whatever the children do.

    ``hurry`` is polled while waiting: once it returns True (a second Ctrl-C), the wait ends
    and the leftovers get SIGKILL at once. Only processes whose pid *and* kernel start time
    match their record are signalled, plus members of their process groups.
    """
    res = StopResult()
    targets: list[tuple[str, int, float]] = []  # name, process group, SIGKILL after
    t0 = time.monotonic()
    if run is not None:  # stopped on purpose: no supervisor restarts them
        run.mark_stopping([r["name"] for r in recs])
    for r in reversed(recs):
        pid, st = int(r["pid"]), r.get("start_time")
        pgid = int(r.get("pgid", pid))
        leader_alive = proc_alive(pid, st)
        if leader_alive or proc_start_time(pid) is None:
            # alive: its group; gone: orphans of it may still carry its group id
            members = group_members(pgid)
        else:
            members = []  # the pid now belongs to an unrelated process: leave it alone
        if leader_alive or members:
            res.stopped.append(r["name"])
            # a process's own grace (a draining router's) when longer than the common one
            own = (r.get("spec") or {}).get("stop_grace_s")
            targets.append((r["name"], pgid, t0 + max(grace_s, float(own or 0.0))))
            _signal_group(pgid, signal.SIGTERM)
    left = list(targets)
    while left:
        hurried = hurry is not None and hurry()
        now = time.monotonic()
        still = []
        for name, pg, kill_at in left:
            if not group_members(pg):
                continue
            if hurried or now >= kill_at:
                res.killed.append(name)
                _signal_group(pg, signal.SIGKILL)
            else:
                still.append((name, pg, kill_at))
        left = still
        if left:
            time.sleep(0.1)
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end and any(group_members(pg) for _, pg, _ in targets):
        time.sleep(0.05)
    if run is not None:
        for r in recs:
            run.remove(r["name"])
    return res


def stop_records(recs: list[dict], run: RunDir | None = None, grace_s: float = 10.0) -> list[str]:
    """:func:`stop_groups` without a hurry; returns the names that were running."""
    return stop_groups(recs, run, grace_s).stopped
