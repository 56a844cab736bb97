"""launch/*.sh: each role script's dry run is exactly the launcher's commands for that role (per
node, for every shipped config), and a role started and stopped on loopback leaves nothing."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stack.launch import cli, role, sglang
from stack.launch.process import group_members, proc_alive
from stack.paths import configs_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "mooncake_master": ROOT / "launch" / "mooncake-master.sh",
    "redis": ROOT / "launch" / "redis.sh",
    "lmcache_server": ROOT / "launch" / "lmcache-server.sh",
    "lmcache_controller": ROOT / "launch" / "lmcache-controller.sh",
    "prefill": ROOT / "launch" / "prefill-pool.sh",
    "decode": ROOT / "launch" / "decode-pool.sh",
    "router": ROOT / "launch" / "router.sh",
}
CONFIGS = sorted(configs_dir().glob("*.yaml"))
ENV = {**os.environ, "SMETRIC_PYTHON": sys.executable}


def _script(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS[name]), *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def _launcher_specs(path: Path, run_dir: Path) -> tuple[dict, list, dict, Path]:
    """What `smetric up` builds for this config (its own load and build)."""
    ns = argparse_ns(path, run_dir)
    cfg = cli.load(ns)
    specs, rcfg, rpath, _ = cli.build(cfg, dry_run=True)
    return cfg, specs, rcfg, rpath


def argparse_ns(path: Path, run_dir: Path):
    import argparse

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["--config", str(path), "--run-dir", str(run_dir)])


def _deployment_configs() -> list[Path]:
    return [p for p in CONFIGS if isinstance((yaml.safe_load(p.read_text()) or {}).get("launch"), dict)]


def test_every_role_has_a_script():
    assert set(SCRIPTS) == set(role.ROLES)
    for s in SCRIPTS.values():
        assert s.exists() and os.access(s, os.X_OK), s
        assert f"-m stack.launch.role {role_of(s)} " in s.read_text()


def test_each_script_explains_itself():
    """`launch/X.sh --help` is the script's own usage (its name, what it starts, the actions);
    a bad action is refused with status 2 and the same usage."""
    for r, path in SCRIPTS.items():
        h = _script(r, "--help")
        assert h.returncode == 0, h.stderr
        rel = f"launch/{path.name}"
        assert h.stdout.startswith(f"usage: {rel} "), h.stdout
        assert role._ABOUT[r] in " ".join(h.stdout.split()) and "stop " in h.stdout, h.stdout
        bad = _script(r, "restart")
        assert bad.returncode == 2 and f"{rel}: error: argument action" in bad.stderr


def role_of(script: Path) -> str:
    return next(r for r, p in SCRIPTS.items() if p == script)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", _deployment_configs(), ids=lambda p: p.stem)
def test_script_dry_runs_equal_the_launchers_commands(config, tmp_path):
    """For every role and every node: the script's specs (JSON) are the launcher's, field by
    field, and its text is the launcher's own dry-run text of those specs."""
    run_dir = tmp_path / "run"
    cfg, specs, rcfg, rpath = _launcher_specs(config, run_dir)
    engine = str(cfg["launch"].get("engine", "emulate"))
    cfg = {k: v for k, v in cfg.items() if k != "_source"}
    full = sglang.dry_run_text(cfg) if engine == "sglang" else None
    covered = []
    for r in role.ROLES:
        mine = [s for s in specs if s.role == r]
        if not mine:
            res = _script(r, "--config", str(config), "--run-dir", str(run_dir), "--dry-run")
            assert res.returncode == 2 and f"starts no {r} process" in res.stderr
            continue
        nodes = list(dict.fromkeys(s.node for s in mine))
        for node in nodes:
            args = ["--config", str(config), "--run-dir", str(run_dir), "--node", node, "--dry-run"]
            js = _script(r, *args, "--format", "json")
            assert js.returncode == 0, js.stderr
            want = [dataclasses.asdict(s) for s in mine if s.node == node]
            assert json.loads(js.stdout) == want
            txt = _script(r, *args)
            assert txt.returncode == 0, txt.stderr
            for s in mine:
                if s.node != node:
                    continue
                block = sglang.spec_text(cfg, s) if engine == "sglang" else cli.emulated_spec_text(s)
                assert block in txt.stdout, "\n".join(
                    difflib.unified_diff(block.splitlines(), txt.stdout.splitlines())
                )
                if full is not None:  # the same block `smetric up --dry-run` prints for that node
                    assert block in full
                covered.append(s.name)
            shown = re.findall(r"^# (\S+) \[(\w+)\]", txt.stdout, re.M)  # each process's header
            assert shown == [(s.name, s.role) for s in mine if s.node == node]
    assert sorted(covered) == sorted(s.name for s in specs if s.role in role.ROLES)


@pytest.mark.timeout(60)
def test_emulated_dry_run_text_matches_smetric_up(tmp_path):
    """The emulated stack's blocks are those of `smetric up --dry-run`, line for line."""
    run_dir = str(tmp_path / "run")
    up = subprocess.run(
        [sys.executable, "-m", "stack.cli", "up", "--dry-run", "--run-dir", run_dir],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 0, up.stderr
    for r in ("mooncake_master", "prefill", "decode", "router"):
        res = _script(r, "--run-dir", run_dir, "--dry-run")
        assert res.returncode == 0, res.stderr
        body = "\n".join(ln for ln in res.stdout.splitlines() if not ln.startswith(("## node", "# engine")))
        for chunk in [c for c in body.split("\n\n") if c.strip()]:
            assert chunk.strip() in up.stdout, chunk


def test_a_role_on_several_nodes_needs_node(tmp_path):
    c = configs_dir() / "qwen3-coder-30b-h20-32p.yaml"
    res = _script("prefill", "start", "--config", str(c), "--run-dir", str(tmp_path))
    assert res.returncode == 2 and "pass --node" in res.stderr
    res = _script("decode", "--config", str(c), "--node", "h20-p0", "--dry-run")
    assert res.returncode == 2 and "no decode process on node h20-p0" in res.stderr
    assert not (tmp_path / "pids").exists()


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _assert_all_gone(recs: list[dict], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    left: list[str] = []
    while time.monotonic() < deadline:
        left = [r["name"] for r in recs if proc_alive(r["pid"], r["start_time"]) or group_members(r["pgid"])]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"still running: {left}")


@pytest.mark.timeout(120)
def test_a_pool_started_and_stopped_on_loopback_leaves_nothing(tmp_path):
    """prefill-pool.sh start: one emulated prefill worker, ready, PID file and log; status;
    decode-pool.sh stop touches nothing of it; prefill-pool.sh stop: no process left."""
    port, boot, ev = _free_ports(3)
    cfg = tmp_path / "c.yaml"
    run_dir = tmp_path / "run"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "m", "page_size": 16},
                "launch": {
                    "engine": "emulate",
                    "run_dir": str(run_dir),
                    "tokenizer": "tiny",
                    "prefill": {"count": 1, "port": port, "bootstrap_port": boot, "kv_events_port": ev},
                    "decode": {"count": 1, "port": _free_ports(1)[0]},
                    "mooncake_master": None,
                    "router": {"enabled": False},
                    "ready_timeout_s": 60,
                },
            }
        )
    )
    recs: list[dict] = []
    try:
        up = _script("prefill", "start", "--config", str(cfg), timeout=90)
        assert up.returncode == 0, up.stderr
        recs = [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]
        assert [r["name"] for r in recs] == ["prefill-0"]
        assert json.loads(up.stdout)["processes"][0]["pid"] == recs[0]["pid"]
        assert proc_alive(recs[0]["pid"], recs[0]["start_time"])
        assert (run_dir / "logs" / "prefill-0.log").exists()
        st = _script("prefill", "status", "--config", str(cfg))
        assert st.returncode == 0 and "running" in st.stdout and "ready" in st.stdout, st.stdout
        again = _script("prefill", "start", "--config", str(cfg))
        assert again.returncode == 2 and "already running" in again.stderr
        other = _script("decode", "stop", "--config", str(cfg))
        assert other.returncode == 0 and "nothing recorded" in other.stdout
        assert proc_alive(recs[0]["pid"], recs[0]["start_time"])
        down = _script("prefill", "stop", "--config", str(cfg))
        assert down.returncode == 0 and "stopped 1 process(es): prefill-0" in down.stdout, down.stdout
        _assert_all_gone(recs)
        assert not list((run_dir / "pids").glob("*.json"))
        st = _script("prefill", "status", "--config", str(cfg))
        assert st.returncode == 3 and "not running" in st.stdout
    finally:
        from stack.launch.process import stop_groups

        stop_groups(recs, None, grace_s=2)


@pytest.mark.timeout(60)
def test_mooncake_master_started_and_stopped_leaves_nothing(tmp_path):
    import shutil

    if shutil.which("mooncake_master") is None:
        pytest.skip("mooncake_master not installed")
    rpc, http, metrics = _free_ports(3)
    cfg = tmp_path / "c.yaml"
    run_dir = tmp_path / "run"
    cfg.write_text(
        yaml.safe_dump(
            {
                "launch": {
                    "engine": "emulate",
                    "run_dir": str(run_dir),
                    "prefill": {"count": 1, "port": _free_ports(1)[0]},
                    "decode": {"count": 1, "port": _free_ports(1)[0]},
                    "mooncake_master": {"rpc_port": rpc, "http_metadata_port": http, "metrics_port": metrics},
                    "router": {"enabled": False},
                },
            }
        )
    )
    recs: list[dict] = []
    try:
        up = _script("mooncake_master", "--config", str(cfg), timeout=45)
        assert up.returncode == 0, up.stderr
        recs = [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]
        assert [r["name"] for r in recs] == ["mooncake-master"]
        down = _script("mooncake_master", "stop", "--config", str(cfg))
        assert down.returncode == 0 and "mooncake-master" in down.stdout, down.stdout
        _assert_all_gone(recs)
    finally:
        from stack.launch.process import stop_groups

        stop_groups(recs, None, grace_s=2)
