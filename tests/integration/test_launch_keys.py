"""`smetric up` with emulated workers and API keys (launch.sglang.api_key_env /
admin_api_key_env, the same keys as the real-SGLang launcher): each worker gets ``--api-key``
from the named env var, the key never enters a spec or the router's config, and the router
sends it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from stack.launch.emulated import plan, process_specs, resolved_config
from stack.launch.spec import LaunchConfigError, expand_secrets
from stack.paths import configs_dir

SMETRIC = [sys.executable, "-m", "stack.cli"]
KEYS = {"api_key_env": "SMETRIC_TEST_UP_KEY", "admin_api_key_env": "SMETRIC_TEST_UP_ADMIN"}


def _cfg(per_process: int = 1) -> dict:
    cfg = yaml.safe_load((configs_dir() / "local.yaml").read_text())
    launch = cfg.setdefault("launch", {})
    launch["ports"] = "auto"
    launch["mooncake_master"] = None
    launch["prefill"] = {**(launch.get("prefill") or {}), "count": 2, "workers_per_process": per_process}
    launch["decode"] = {**(launch.get("decode") or {}), "count": 1}
    launch["sglang"] = dict(KEYS)
    return cfg


@pytest.mark.parametrize("per_process", [1, 2])
def test_worker_specs_carry_the_key_by_name_only(tmp_path, per_process):
    cfg = _cfg(per_process)
    p = plan(cfg)
    specs = [s for s in process_specs(cfg, p, tmp_path / "r.yaml") if s.role in ("prefill", "decode")]
    assert specs
    env = {KEYS["api_key_env"]: "k-1", KEYS["admin_api_key_env"]: 'adm"2'}
    for s in specs:
        assert sorted(s.secret_env) == sorted(KEYS.values())
        assert "k-1" not in " ".join(s.argv)
        argv = expand_secrets(s, env)
        assert argv[argv.index("--api-key") + 1] == "k-1"
        assert argv[argv.index("--admin-api-key") + 1] == 'adm"2'
        if "--pool" in argv:  # the keys stay outside the members' JSON, which still parses
            members = json.loads(argv[argv.index("--pool") + 1])
            assert len(members) == 2 and all("--api-key" not in m for m in members)
    with pytest.raises(LaunchConfigError, match=KEYS["api_key_env"]):
        expand_secrets(specs[0], {})
    auth = resolved_config(cfg, p)["router"]["auth"]
    assert auth["worker_api_key_env"] == KEYS["api_key_env"]
    assert auth["worker_admin_api_key_env"] == KEYS["admin_api_key_env"]


@pytest.mark.timeout(120)
def test_up_with_worker_keys_serves_through_the_router(tmp_path):
    cfg = _cfg()
    cfg["launch"]["prefill"]["count"] = 1
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    env = {**os.environ, KEYS["api_key_env"]: "worker-key-1", KEYS["admin_api_key_env"]: "admin-key-1"}
    up = [*SMETRIC, "up", "--config", str(path), "--run-dir", str(run_dir), "--detach"]
    r = subprocess.run(up, capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        info = json.loads(r.stdout.strip().splitlines()[-1])
        router = info["router_url"]
        rcfg = (run_dir / "router-config.yaml").read_text()
        assert "worker-key-1" not in rcfg and KEYS["api_key_env"] in rcfg
        worker = yaml.safe_load(rcfg)["prefill"][0]["url"]
        body = {
            "model": cfg["model"]["name"],
            "messages": [{"role": "user", "content": "hi " * 40}],
            "max_tokens": 3,
        }
        with httpx.Client(timeout=30) as c:
            assert c.post(worker + "/generate", json={"text": "hi", "sampling_params": {}}).status_code == 401
            ok = c.post(
                worker + "/generate",
                json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                headers={"authorization": "Bearer worker-key-1"},
            )
            assert ok.status_code == 200, ok.text
            resp = c.post(router + "/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
    finally:
        subprocess.run([*SMETRIC, "down", "--run-dir", str(run_dir)], capture_output=True, timeout=60)


def test_a_bad_key_env_name_is_refused(tmp_path):
    cfg = _cfg()
    cfg["launch"]["sglang"] = {"api_key_env": "not a name"}
    with pytest.raises(LaunchConfigError, match="api_key_env"):
        process_specs(cfg, plan(cfg), Path(tmp_path / "r.yaml"))
