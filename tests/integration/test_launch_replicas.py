"""`smetric up` with several router replicas behind one Redis (launch.router.replicas,
--router-replicas): the emulated stack end to end, and the process specs of the SGLang path."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stack.launch import cli as up_cli
from stack.launch import replicas
from stack.launch.emulated import all_ports
from stack.launch.process import group_members, proc_alive
from stack.launch.redis_server import require_redis_server
from stack.launch.sglang import (
    LaunchConfigError,
    dry_run_text,
    load_yaml,
    resolved_config,
    sglang_process_specs,
)
from stack.paths import configs_dir
from stack.ports import free_port

SMETRIC = [sys.executable, "-m", "stack.cli"]
H200 = configs_dir() / "qwen3-coder-30b-h200-1node.yaml"
TOKEN = "replica-test-token"


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


# --- the emulated stack, for real ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_up_two_replicas_share_state_and_down_stops_everything(tmp_path):
    require_redis_server()  # fails (never skips) without redis-server, as the replica tests do
    run_dir = tmp_path / "run"
    env = {**os.environ, "SMETRIC_ADMIN_TOKEN": TOKEN}
    up = [
        *SMETRIC, "up", "--prefill", "1", "--decode", "1", "--no-mooncake", "--ports", "auto",
        "--router-replicas", "2", "--run-dir", str(run_dir), "--detach",
    ]  # fmt: skip
    r = subprocess.run(up, capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    recs = _records(run_dir)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        info = json.loads(r.stdout.strip().splitlines()[-1])
        urls = info["router_urls"]
        assert len(urls) == 2 and info["router_url"] == urls[0] and urls[0] != urls[1]
        state = json.loads((run_dir / "state.json").read_text())
        assert state["router_urls"] == urls and state["redis_url"].startswith("redis://127.0.0.1:")
        assert sorted(x["name"] for x in recs) == ["decode-0", "prefill-0", "redis", "router-0", "router-1"]
        assert all(proc_alive(x["pid"], x["start_time"]) for x in recs)
        with httpx.Client(timeout=30) as c:
            for i, u in enumerate(urls):
                # a replica whose first Redis round trip timed out (0.1 s on a loaded machine)
                # joins on its next heartbeat: wait for that, bounded
                _wait(lambda u=u: c.get(u + "/health").json()["shared_state"] == "up", timeout=30)
                h = c.get(u + "/health").json()
                assert h["shared_state"] == "up" and h["replica"] == f"r{i}", h
                body = {
                    "model": c.get(u + "/v1/models").json()["data"][0]["id"],  # the served name
                    "messages": [{"role": "user", "content": f"hi {i} " * 50}],
                    "max_tokens": 3,
                }
                resp = c.post(u + "/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 3
            # an admin add on replica 0 reaches replica 1 through Redis
            auth = {"authorization": f"Bearer {TOKEN}"}
            extra = f"http://127.0.0.1:{free_port()}"
            a = c.post(urls[0] + "/admin/workers", json={"url": extra, "bootstrap_port": 9009}, headers=auth)
            assert a.status_code == 201, a.text

            def seen() -> bool:
                ws = c.get(urls[1] + "/admin/workers", headers=auth).json()["workers"]
                return any(w["url"] == extra for w in ws)

            _wait(seen, timeout=10)
        # nothing of redis lands in the working directory
        assert not list(tmp_path.glob("dump.rdb")) and not list(tmp_path.glob("appendonly*"))
        assert (run_dir / "logs" / "redis.log").exists()
    finally:
        d = subprocess.run(
            [*SMETRIC, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60
        )
    assert d.returncode == 0 and "stopped 5 process(es)" in d.stdout, d.stdout + d.stderr
    # every process stopped on SIGTERM (none needed SIGKILL): the routers drained and exited
    assert "SIGKILL" not in d.stdout, d.stdout
    for i in (0, 1):
        assert "drained: stopping" in (run_dir / "logs" / f"router-{i}.log").read_text()
    deadline = time.monotonic() + 10
    left = recs
    while left and time.monotonic() < deadline:
        left = [x["name"] for x in recs if proc_alive(x["pid"], x["start_time"]) or group_members(x["pgid"])]
        time.sleep(0.1)
    assert not left, f"still running: {left}"
    assert _records(run_dir) == [] and not (run_dir / "state.json").exists()


# --- plan and specs (no process started) ----------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_flag_sets_replicas_and_a_redis(tmp_path):
    cfg = up_cli.load(_args("--router-replicas", "3", "--run-dir", str(tmp_path)))
    launch = cfg["launch"]
    assert launch["router"]["replicas"] == 3
    assert launch["redis"] == {"port": 8000 + replicas.AUTO_REDIS_OFFSET, "auto": True}
    specs, rcfg, _, url = up_cli.build(cfg, dry_run=True)
    routers = [s for s in specs if s.role == "router"]
    assert [s.name for s in routers] == ["router-0", "router-1", "router-2"]
    assert [s.ready_port for s in routers] == [8000, 8001, 8002]
    assert [_flag(s.argv, "--replica-id") for s in routers] == ["r0", "r1", "r2"]
    assert [_flag(s.argv, "--port") for s in routers] == ["8000", "8001", "8002"]
    assert url == "http://127.0.0.1:8000" and rcfg["router"]["redis_url"] == "redis://127.0.0.1:8379/0"
    redis = next(s for s in specs if s.role == "redis")
    assert redis.argv[:3] == ["redis-server", "--port", "8379"] and redis.ready_port == 8379
    assert _flag(redis.argv, "--save") == "" and _flag(redis.argv, "--appendonly") == "no"
    # started before the routers (first phase), one config file for every replica
    assert up_cli.PHASES[0] == ("mooncake_master", "redis", "metadata")
    assert len({_flag(s.argv, "--config") for s in routers}) == 1
    # one replica: the single router exactly as before, no Redis
    one = up_cli.load(_args("--run-dir", str(tmp_path)))
    specs1, rcfg1, _, _ = up_cli.build(one, dry_run=True)
    assert [s.name for s in specs1 if s.role == "router"] == ["router"]
    assert "--replica-id" not in specs1[-1].argv and "redis" not in {s.role for s in specs1}
    assert "redis_url" not in rcfg1["router"]


def test_auto_ports_are_distinct_and_checked(tmp_path):
    cfg = up_cli.load(
        _args("--router-replicas", "2", "--ports", "auto", "--no-mooncake", "--run-dir", str(tmp_path))
    )
    specs, _, _, _ = up_cli.build(cfg, dry_run=True)
    plan = cfg["launch"]["_plan"]
    bound = all_ports(plan)  # what `smetric up` checks for "ports in use"
    assert {"router-0.port", "router-1.port", "redis.port"} <= {w for w, _ in bound}
    assert len({p for _, p in bound}) == len(bound)
    assert [s.ready_port for s in specs if s.role == "router"] == plan["router"]["ports"]


def test_explicit_ports_external_redis_and_refusals(tmp_path):
    base = {"router": {"port": 9000}, "launch": {"router": {"ports": [9100, 9200]}}}
    cfg = replicas.ensure_redis(copy.deepcopy(base))
    assert replicas.replica_count(cfg["launch"]) == 2 and replicas.replica_ports(cfg) == [9100, 9200]
    assert cfg["launch"]["redis"]["port"] == 9379
    ext = replicas.ensure_redis(
        {"router": {"redis_url": "redis://10.0.0.5:6379/0"}, "launch": {"router": {"replicas": 2}}}
    )
    assert "redis" not in ext["launch"]  # an external Redis: nothing to start
    with pytest.raises(ValueError, match="launch.redis is null"):
        replicas.ensure_redis({"launch": {"router": {"replicas": 2}, "redis": None}})
    with pytest.raises(ValueError, match="one port per replica"):
        replicas.replica_ports({"launch": {"router": {"replicas": 3, "ports": [1, 2]}}})
    with pytest.raises(ValueError, match="replicas"):
        replicas.replica_count({"router": {"replicas": 0}})
    # a disabled router or a single replica: untouched
    assert (
        "redis"
        not in replicas.ensure_redis({"launch": {"router": {"replicas": 3, "enabled": False}}})["launch"]
    )


def test_sglang_specs_have_n_routers_and_the_redis(tmp_path):
    cfg = load_yaml(H200)
    cfg["launch"]["router"] = {**(cfg["launch"].get("router") or {}), "replicas": 3}
    cfg["launch"].pop("redis", None)
    replicas.ensure_redis(cfg)
    specs = sglang_process_specs(cfg)
    routers = [s for s in specs if s.role == "router"]
    port = int((cfg.get("router") or {}).get("port", 8000))
    assert [s.name for s in routers] == ["router-0", "router-1", "router-2"]
    assert [s.ready_port for s in routers] == [port, port + 1, port + 2]
    assert [_flag(s.argv, "--port") for s in routers] == [str(port + i) for i in range(3)]
    assert [_flag(s.argv, "--replica-id") for s in routers] == ["r0", "r1", "r2"]
    assert len({s.ready_url for s in routers}) == 3 and len({s.node for s in routers}) == 1
    redis = [s for s in specs if s.role == "redis"]
    assert len(redis) == 1 and _flag(redis[0].argv, "--port") == str(port + replicas.AUTO_REDIS_OFFSET)
    assert _flag(redis[0].argv, "--save") == "" and _flag(redis[0].argv, "--appendonly") == "no"
    order = [s.role for s in specs]
    assert order.index("redis") < order.index("prefill") < order.index("router")
    rc = resolved_config(cfg)
    assert rc["router"]["redis_url"] == f"redis://{routers[0].host}:{port + replicas.AUTO_REDIS_OFFSET}/0"
    text = dry_run_text(cfg)  # the router config is written once, every replica is shown
    assert text.count("router-config.yaml <<'EOF'") == 1
    assert all(f"# router-{i} [router]" in text for i in range(3)) and "--replica-id r2" in text
    # an explicit launch.redis and a ports list are honoured
    cfg2 = load_yaml(H200)
    cfg2["launch"]["router"] = {"ports": [18000, 18500]}
    cfg2["launch"]["redis"] = {"port": 6390}
    replicas.ensure_redis(cfg2)
    specs2 = sglang_process_specs(cfg2)
    assert [s.ready_port for s in specs2 if s.role == "router"] == [18000, 18500]
    assert _flag(next(s for s in specs2 if s.role == "redis").argv, "--port") == "6390"
    assert resolved_config(cfg2)["router"]["port"] == 18000
    with pytest.raises(LaunchConfigError, match="one port per replica"):
        bad = load_yaml(H200)
        bad["launch"]["router"] = {"replicas": 2, "ports": [1]}
        sglang_process_specs(bad)


def test_router_cli_takes_the_replica_id(tmp_path):
    from stack.prefill_router.service import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--prefill", "http://127.0.0.1:1", "--port", "8123", "--replica-id", "r7"])
    c = config_from_args(a)
    assert c.router.replica_id == "r7" and c.router.port == 8123
