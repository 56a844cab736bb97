"""`smetric up` / `smetric down` on loopback: the local PD stack comes up healthy, serves a
request through the router, and leaves no process behind (down, or Ctrl-C in the foreground)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stack.launch.loopback import client, mooncake_skip_reason
from stack.launch.process import group_members, proc_alive

_skip = mooncake_skip_reason()
needs_mooncake = pytest.mark.skipif(_skip is not None, reason=_skip or "")
SMETRIC = [sys.executable, "-m", "stack.cli"]


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([*SMETRIC, *args], capture_output=True, text=True, timeout=timeout)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]


def _assert_all_gone(recs: list[dict], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [r["name"] for r in recs if proc_alive(r["pid"], r["start_time"]) or group_members(r["pgid"])]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"still running: {left}")


@pytest.mark.timeout(60)
def test_dry_run_prints_the_whole_stack(tmp_path):
    r = _run(["up", "--dry-run", "--ports", "auto", "--run-dir", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("--mode prefill") == 4 and out.count("--mode decode") == 2
    assert "mooncake_master" in out and "--enable_http_metadata_server=true" in out
    assert " router --config " in out and "kv-events-endpoint" in out
    assert not (tmp_path / "run" / "pids").exists() or not list((tmp_path / "run" / "pids").iterdir())


@pytest.mark.timeout(60)
def test_up_refuses_ports_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"launch:\n  engine: emulate\n  prefill: {{count: 1, port: {busy}}}\n  decode: {{count: 1}}\n"
            "  mooncake_master: null\n  router: {enabled: false}\n"
        )
        r = _run(["up", "--config", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert r.returncode == 2 and f"prefill-0.port={busy}" in r.stderr and "--ports auto" in r.stderr


@pytest.mark.timeout(150)
@pytest.mark.mooncake
@needs_mooncake
def test_up_serves_through_the_router_and_down_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = _run(
        ["up", "--prefill", "2", "--decode", "1", "--ports", "auto", "--run-dir", str(run_dir), "--detach"],
        timeout=120,
    )
    recs = _records(run_dir)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        info = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(info["prefill"]) == 2 and len(info["decode"]) == 1
        assert {x["role"] for x in recs} == {"mooncake_master", "prefill", "decode", "router"}
        assert all(proc_alive(x["pid"], x["start_time"]) for x in recs)
        # the real HTTP path: router -> prefill + decode (PD hand-off through Mooncake)
        model = client().get(info["router_url"] + "/v1/models").json()["data"][0]["id"]  # the served name
        body = {"model": model, "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 5}
        resp = client().post(info["router_url"] + "/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
        for u in info["prefill"] + info["decode"]:
            assert client().get(u + "/health").status_code == 200
        # a second `up` on the same run dir refuses
        again = _run(["up", "--ports", "auto", "--run-dir", str(run_dir), "--detach"])
        assert again.returncode == 2 and "still running" in again.stderr
    finally:
        d = _run(["down", "--run-dir", str(run_dir)])
    assert d.returncode == 0 and "stopped 5 process(es)" in d.stdout, d.stdout + d.stderr
    _assert_all_gone(recs)
    assert _records(run_dir) == []
    assert "nothing recorded" in _run(["down", "--run-dir", str(run_dir)]).stdout


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is already full and that nobody reads: any blocking write to its
    write end hangs (what an undrained stdout/stderr pipe becomes)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)  # the launcher gets a normal, blocking, full pipe
    return r, w


def _ignore_sigint() -> None:  # as a background job of a non-interactive shell starts
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_foreground(run_dir: Path, stderr, preexec=None) -> tuple[subprocess.Popen, dict, list[dict]]:
    p = subprocess.Popen(
        [*SMETRIC, "up", "--prefill", "1", "--decode", "1", "--no-router", "--ports", "auto"]
        + ["--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
        preexec_fn=preexec,
    )
    line = p.stdout.readline()  # the JSON summary, printed once healthy
    if not line.strip():  # startup failed: say why (the launcher's stderr, when it is a file)
        p.wait(30)
        name = getattr(stderr, "name", None)
        why = Path(name).read_text()[-3000:] if isinstance(name, str) else "(stderr not kept)"
        raise AssertionError(f"smetric up printed no summary (rc={p.returncode}):\n{why}")
    info = json.loads(line)
    assert len(info["prefill"]) == 1 and info["router_url"] is None
    recs = _records(run_dir)
    assert len(recs) == 3
    return p, info, recs


def _cleanup(p: subprocess.Popen, run_dir: Path) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()
    for r in _records(run_dir):  # a SIGSTOPped worker must not outlive a failed test
        try:
            os.killpg(r["pgid"], signal.SIGCONT)
        except OSError:
            pass
    _run(["down", "--run-dir", str(run_dir), "--grace", "1"])


@pytest.mark.timeout(120)
@pytest.mark.mooncake
@needs_mooncake
@pytest.mark.parametrize("how", ["plain", "sigint-ignored", "stderr-full-pipe"])
def test_ctrl_c_in_the_foreground_cleans_up(tmp_path, how):
    """One Ctrl-C stops the stack within a bound, also when the launcher inherited an ignored
    SIGINT (a script's background job) or writes to a full pipe nobody reads."""
    run_dir = tmp_path / "run"
    fds: list[int] = []
    stderr = open(tmp_path / "err", "w")
    if how == "stderr-full-pipe":
        fds = list(_full_pipe())
        stderr.close()
        stderr = fds[1]
    p, _, recs = _start_foreground(run_dir, stderr, _ignore_sigint if how == "sigint-ignored" else None)
    try:
        os.kill(p.pid, signal.SIGINT)
        assert p.wait(40) == 0
        _assert_all_gone(recs)
        assert _records(run_dir) == []
        if how != "stderr-full-pipe":
            assert "stopped: decode-0, prefill-0, mooncake-master" in (tmp_path / "err").read_text()
    finally:
        _cleanup(p, run_dir)
        for fd in fds:
            os.close(fd)
        if not isinstance(stderr, int):
            stderr.close()


@pytest.mark.timeout(120)
@pytest.mark.mooncake
@needs_mooncake
@pytest.mark.parametrize("second_ctrl_c", [False, True])
def test_a_worker_that_does_not_stop_is_killed_and_said_so(tmp_path, second_ctrl_c):
    """A worker that ignores SIGTERM (here: SIGSTOPped, so SIGTERM stays pending) gets SIGKILL
    after the grace period, or at once on a second Ctrl-C; the launcher says which."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "err", "w") as err:
        p, _, recs = _start_foreground(run_dir, err)
        try:
            worker = next(r for r in recs if r["role"] == "prefill")
            os.kill(worker["pid"], signal.SIGSTOP)
            t0 = time.monotonic()
            os.kill(p.pid, signal.SIGINT)
            if second_ctrl_c:
                deadline = time.monotonic() + 20
                while "stopping" not in (tmp_path / "err").read_text() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.3)
                os.kill(p.pid, signal.SIGINT)
            assert p.wait(40) == 0
            took = time.monotonic() - t0
            _assert_all_gone(recs)
            text = (tmp_path / "err").read_text()
            why = "a second Ctrl-C" if second_ctrl_c else "no exit 10 s after SIGTERM"
            killed = re.search(rf"killed \(SIGKILL, {why}\): (.*)", text)
            assert killed and "prefill-0" in killed.group(1).split(", "), text
            if second_ctrl_c:
                assert took < 9, took  # well inside the 10 s grace it would otherwise wait out
            else:
                assert took >= 9.5, took
        finally:
            _cleanup(p, run_dir)


@pytest.mark.timeout(60)
def test_plan_and_router_config_follow_the_schema(tmp_path):
    import yaml

    from stack.config import parse_config
    from stack.launch import emulated
    from stack.launch.cli import default_config
    from stack.worker.settings import settings_from_config

    cfg = yaml.safe_load(default_config().read_text())
    fixed = emulated.plan(cfg)
    assert [w["port"] for w in fixed["prefill"]] == [30000, 30010, 30020, 30030]
    assert [w["bootstrap_port"] for w in fixed["prefill"]] == [8998, 9008, 9018, 9028]
    assert len(fixed["decode"]) == 2 and fixed["master"]["rpc_port"] == 50051
    cfg["launch"]["ports"] = "auto"
    p = emulated.plan(cfg)
    ports = [port for _, port in emulated.all_ports(p)]
    assert (
        len(ports) == len(set(ports)) == 3 + 4 * 4 + 2 + 1
    )  # a prefill worker: http, bootstrap, events, replay
    rc = emulated.resolved_config(cfg, p)
    dc = parse_config(rc)  # the router's own schema accepts it
    assert len(dc.prefill) == 4 and dc.prefill[0].kv_events.startswith("tcp://127.0.0.1:")
    assert dc.mooncake.master == f"127.0.0.1:{p['master']['rpc_port']}"
    assert dc.mooncake.metadata_url.endswith("/metadata")
    specs = emulated.process_specs(cfg, p, tmp_path / "router.yaml")
    assert [s.role for s in specs] == ["mooncake_master"] + ["prefill"] * 4 + ["decode"] * 2 + ["router"]
    # a worker started with --config takes the emulator section and the model's page size
    s = settings_from_config(default_config())
    assert s["time_factor"] == cfg["launch"]["emulator"]["time_factor"] and s["page_size"] == 64
