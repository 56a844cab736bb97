"""The router replicas' Redis with a password whenever it listens beyond loopback, and TLS as an
option (stack/launch/replicas.py; docs/deploy/bare-metal.md, "Router replicas").

The specs of both launchers (emulated and SGLang) for a Redis beyond loopback: redis-server gets
``--requirepass $(SMETRIC_REDIS_PASSWORD)``, the routers the same variable (their config names it,
the launcher refuses to start them without it), and no spec, dry run or router config holds the
value. Live: `smetric up` with two router replicas and a Redis that asks for a password over TLS
(a CA and a certificate made here with openssl): the password is generated once into the run
dir (0600), both replicas reach their shared state, and Redis refuses a client without TLS or
without the password."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from stack.config import parse_config
from stack.launch import emulated, replicas
from stack.launch.redis_server import require_redis_server
from stack.launch.sglang import dry_run_text, resolved_config, sglang_process_specs
from stack.launch.spec import LaunchConfigError, expand_secrets
from stack.paths import configs_dir

ENV = replicas.REDIS_PASSWORD_ENV


def _emulated(bind: str, **redis_section) -> dict:
    return {
        "model": {"name": "tiny"},
        "router": {"port": 8000},
        "launch": {
            "engine": "emulate",
            "bind_host": bind,
            "prefill": {"count": 1},
            "decode": {"count": 1},
            "mooncake_master": None,
            "router": {"replicas": 2},
            "redis": {"port": 8379, **redis_section},
        },
    }


def _specs(cfg: dict) -> tuple[list, dict]:
    p = emulated.plan(cfg)
    return emulated.process_specs(cfg, p, "/tmp/router-config.yaml"), emulated.resolved_config(cfg, p)


def test_redis_beyond_loopback_gets_a_password_from_the_environment():
    specs, rcfg = _specs(_emulated("10.1.2.3"))
    (rd,) = [s for s in specs if s.role == "redis"]
    assert rd.argv[rd.argv.index("--requirepass") + 1] == f"$({ENV})" and rd.secret_env == [ENV]
    assert rd.argv[rd.argv.index("--protected-mode") + 1] == "no"
    routers = [s for s in specs if s.role == "router"]
    assert len(routers) == 2 and all(ENV in s.secret_env for s in routers)
    assert rcfg["router"]["redis_password_env"] == ENV
    assert rcfg["router"]["redis_url"] == "redis://10.1.2.3:8379/0"  # the value never in a URL
    with pytest.raises(LaunchConfigError, match=ENV):  # nothing starts without it
        expand_secrets(rd, {})
    assert expand_secrets(rd, {ENV: "s3cret"})[rd.argv.index("--requirepass") + 1] == "s3cret"


def test_a_loopback_redis_has_none_unless_asked():
    specs, rcfg = _specs(_emulated("127.0.0.1"))
    (rd,) = [s for s in specs if s.role == "redis"]
    assert "--requirepass" not in rd.argv and not rd.secret_env
    assert "redis_password_env" not in rcfg["router"]
    specs, rcfg = _specs(_emulated("127.0.0.1", password=True, password_env="MY_REDIS_PW"))
    (rd,) = [s for s in specs if s.role == "redis"]
    assert rd.secret_env == ["MY_REDIS_PW"] and rcfg["router"]["redis_password_env"] == "MY_REDIS_PW"


def test_no_password_beyond_loopback_is_refused():
    with pytest.raises(replicas.ReplicaConfigError, match="beyond loopback"):
        _specs(_emulated("0.0.0.0", password=False))
    with pytest.raises(replicas.ReplicaConfigError, match="password_env"):
        _specs(_emulated("0.0.0.0", password_env="not a name"))


def test_sglang_two_nodes_redis_and_routers_share_the_variable():
    cfg = yaml.safe_load((configs_dir() / "qwen3-coder-30b-h200-2node.yaml").read_text())
    replicas.ensure_redis(cfg)  # 2 replicas and no Redis given: the launcher adds one (smetric up does)
    specs = sglang_process_specs(cfg)
    (rd,) = [s for s in specs if s.role == "redis"]
    assert rd.host == "10.0.0.1" and rd.secret_env == [ENV] and f"$({ENV})" in rd.argv
    assert all(ENV in s.secret_env for s in specs if s.role == "router")
    assert resolved_config(cfg)["router"]["redis_password_env"] == ENV
    text = dry_run_text(cfg)  # the shell expands the variable; the value is never printed
    assert f'--requirepass "${ENV}"' in text and f"redis_password_env: {ENV}" in text


def test_tls_redis_speaks_only_tls_and_the_routers_use_rediss():
    tls = {"cert_file": "/etc/r/tls.crt", "key_file": "/etc/r/tls.key", "ca_file": "/etc/r/ca.crt"}
    specs, rcfg = _specs(_emulated("127.0.0.1", tls=tls))
    (rd,) = [s for s in specs if s.role == "redis"]
    a = rd.argv
    assert a[a.index("--port") + 1] == "0" and a[a.index("--tls-port") + 1] == "8379"
    assert a[a.index("--tls-ca-cert-file") + 1] == "/etc/r/ca.crt"
    assert rcfg["router"]["redis_url"] == "rediss://127.0.0.1:8379/0?ssl_ca_certs=/etc/r/ca.crt"
    with pytest.raises(replicas.ReplicaConfigError, match="tls"):
        _specs(_emulated("127.0.0.1", tls={"cert_file": "/x"}))


def test_the_password_is_generated_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    first = replicas.ensure_password(ENV, tmp_path)
    f = tmp_path / replicas.PASSWORD_FILE
    assert len(first) >= 32 and os.environ[ENV] == first
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    monkeypatch.delenv(ENV)
    assert replicas.ensure_password(ENV, tmp_path) == first  # a later start: the same one
    monkeypatch.setenv(ENV, "given")
    assert replicas.ensure_password(ENV, tmp_path) == "given"  # the environment's wins


def test_the_router_config_adds_the_password_from_its_variable(monkeypatch):
    monkeypatch.setenv("PW", "p@ss/word")
    rc = {"redis_url": "rediss://10.0.0.1:6380/0?ssl_ca_certs=/c.crt", "redis_password_env": "PW"}
    url = parse_config({"router": rc}).router.redis_url
    assert url == "rediss://:p%40ss%2Fword@10.0.0.1:6380/0?ssl_ca_certs=/c.crt"
    assert redis.connection.parse_url(url)["password"] == "p@ss/word"


def _tls_files(d: Path) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 it signed (openssl)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=smetric-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "redis.key", "-out", "redis.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "redis.crt", "-days", "1", "-extfile", "san.cnf")  # fmt: skip
    return {"cert_file": str(d / "redis.crt"), "key_file": str(d / "redis.key"), "ca_file": str(d / "ca.crt")}


def _smetric(*args: str, env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.timeout(180)
def test_live_replicas_share_state_through_a_password_and_tls_redis(tmp_path):
    require_redis_server()
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not on PATH (Debian's openssl)")
    tls = _tls_files(tmp_path)
    cfg = {
        "model": {"name": "tiny", "page_size": 16, "context_length": 8192},
        "router": {"policy": "smetric"},
        "launch": {
            "engine": "emulate",
            "tokenizer": "tiny",
            "prefill": {"count": 2, "workers_per_process": 2},
            "decode": {"count": 1},
            "mooncake_master": None,
            "emulator": {"time_factor": 0.01},
            "router": {"replicas": 2},
            "redis": {"port": 6379, "password": True, "tls": tls},
        },
    }
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the launcher must make one
    up = _smetric("up", "--config", str(tmp_path / "stack.yaml"), "--ports", "auto", "--run-dir", str(run),
                  "--detach", env=env)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        info = json.loads(up.stdout.strip().splitlines()[-1])
        pw_file = run / replicas.PASSWORD_FILE
        password = pw_file.read_text().strip()
        assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600 and len(password) >= 32
        for u in info["router_urls"]:
            h = httpx.get(u + "/health", timeout=10).json()
            assert h["shared_state"] == "up", h
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert httpx.post(u + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        rc = yaml.safe_load((run / "router-config.yaml").read_text())["router"]
        assert rc["redis_password_env"] == ENV and rc["redis_url"].startswith("rediss://127.0.0.1:")
        for f in (run / "router-config.yaml", run / "state.json"):
            assert password not in f.read_text(), f
        port = int(rc["redis_url"].split(":")[2].split("/")[0])
        ok = redis.Redis(
            host="127.0.0.1", port=port, password=password, ssl=True, ssl_ca_certs=tls["ca_file"]
        )
        assert ok.ping() and any(k.startswith(b"smetric:") for k in ok.keys())
        with pytest.raises(redis.AuthenticationError):  # TLS without the password
            redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=tls["ca_file"]).set("x", 1)
        with pytest.raises(redis.ConnectionError):  # the password without TLS
            redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2).ping()
    finally:
        _smetric("down", "--run-dir", str(run), env=env, timeout=60)
