"""Restart what dies: the supervisor of a run dir's processes (router, workers, mooncake_master).

Every process the launcher starts has a record in the run dir (``pids/<name>.json``) that
carries its whole spec. The supervisor polls the records; a recorded process that is gone
without having been stopped on purpose is started again from its spec, after a back-off that
doubles with each restart in a row (1, 2, 4, ... up to 30 s) and resets once the process has
stayed up a minute. Stopping on purpose marks the records first (``stopping``: ``smetric
down``, ``launch/*.sh stop``, the foreground launcher's Ctrl-C), and a marked record is never
restarted, so the supervisor does not fight a stop, a drain or a rolling upgrade.

``smetric up`` supervises in its own process in the foreground, and starts this module as a
process of its own with ``--detach`` (``python -m stack.launch.supervise --run-dir DIR``; its
PID file is ``supervisor.json`` beside ``pids/``, and ``smetric down`` stops it first).
``launch.supervise: false`` turns both off.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stack.launch.process import RunDir, proc_alive, proc_start_time, start
from stack.launch.spec import ProcessSpec

log = logging.getLogger("stack.launch.supervise")

#: back-off between restarts in a row: the first, the cap; reset after STABLE_S up
BACKOFF_S = (1.0, 30.0)
STABLE_S = 60.0


@dataclass
class _Track:
    restarts: int = 0  # in a row
    next_try: float = 0.0
    up_since: float = field(default_factory=time.monotonic)


class Supervisor:
    """Restarts the dead, unmarked processes recorded in ``run`` (one :meth:`check` a poll)."""

    def __init__(self, run: RunDir, say=None) -> None:
        self.run = run
        self.say = say or (lambda text: log.warning("%s", text))
        self.tracks: dict[str, _Track] = {}
        self.restarted = 0

    def check(self, now: float | None = None) -> list[str]:
        """One pass: the names restarted now."""
        now = time.monotonic() if now is None else now
        out = []
        for rec in self.run.records():
            name = rec["name"]
            if rec.get("stopping") or "spec" not in rec:
                continue
            t = self.tracks.setdefault(name, _Track())
            if proc_alive(int(rec["pid"]), rec.get("start_time")):
                if t.restarts and now - t.up_since >= STABLE_S:
                    t.restarts = 0
                continue
            if now < t.next_try:
                continue
            if self.run.record(name).get("stopping"):  # marked since the listing
                continue
            m = start(
                ProcessSpec(**rec["spec"]),
                self.run,
                int(rec.get("seq", 0)),
                restarts=rec.get("restarts", 0) + 1,
            )
            t.restarts += 1
            t.up_since = now
            t.next_try = now + min(BACKOFF_S[0] * 2 ** (t.restarts - 1), BACKOFF_S[1])
            self.restarted += 1
            out.append(name)
            self.say(f"{name} was gone: restarted (pid {m.pid}, restart {t.restarts} in a row; log {m.log})")
        return out


def write_pid(run: RunDir) -> None:
    pid = os.getpid()
    run.supervisor_file.write_text(json.dumps({"pid": pid, "start_time": proc_start_time(pid)}))


def supervisor_running(run: RunDir) -> bool:
    """Whether the run dir's supervisor process runs (a stale PID file is removed)."""
    try:
        rec = json.loads(run.supervisor_file.read_text())
    except (OSError, ValueError):
        return False
    if proc_alive(int(rec["pid"]), rec.get("start_time")):
        return True
    run.supervisor_file.unlink(missing_ok=True)
    return False


def stop_supervisor(run: RunDir, grace_s: float = 5.0) -> bool:
    """Stop the run dir's supervisor process, if one runs (before its processes are stopped,
    so that it restarts none of them); True when one was running."""
    try:
        rec = json.loads(run.supervisor_file.read_text())
    except (OSError, ValueError):
        return False
    pid, st = int(rec["pid"]), rec.get("start_time")
    running = proc_alive(pid, st)
    if running:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while proc_alive(pid, st) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc_alive(pid, st):
            os.kill(pid, signal.SIGKILL)
    run.supervisor_file.unlink(missing_ok=True)
    return running


def spawn(run: RunDir) -> int:
    """Start the supervisor of ``run`` as a process of its own (``--detach``); its pid."""
    import subprocess

    log_path = run.logs / "supervisor.log"
    with open(log_path, "ab") as fh:
        p = subprocess.Popen(
            [sys.executable, "-m", "stack.launch.supervise", "--run-dir", str(run.path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + 10
    while not run.supervisor_file.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return p.pid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stack.launch.supervise",
        description="Restart the processes of a run dir that die (not those stopped on purpose), with back-off.",
    )
    ap.add_argument("--run-dir", required=True, help="the run dir whose pids/ records to supervise")
    ap.add_argument("--poll-s", type=float, default=0.5, help="seconds between two checks")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor: %(message)s")
    run = RunDir(Path(a.run_dir))
    write_pid(run)
    stop = False

    def _stop(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sup = Supervisor(run)
    log.info("supervising %s", run.path)
    while not stop:
        try:
            sup.check()
        except Exception:  # noqa: BLE001 - a bad record must not end supervision
            log.exception("check failed")
        time.sleep(a.poll_s)
    log.info("stopped (%d restarts)", sup.restarted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
