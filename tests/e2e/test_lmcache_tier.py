"""Real LMCache on CPU (its own environment, .ci/install-lmcache.sh): the launch/ scripts start
and stop LMCache's controller and server on loopback and leave nothing; two LMCache engines
(one per emulated worker, stack.kv_tier.lmcache_engine_sidecar) share KV through a real
mooncake_master, so a follow-up migrated to the other worker gets its prefix back through
LMCache, byte for byte; and the router's LMCache view (the controller's lookup) predicts that
hit within one 256-token chunk, and falls back to its own index when the controller is down.

Without LMCache's environment these tests skip with the reason (under CI=true they fail).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stack.kv_tier.global_index import WrittenIndex
from stack.kv_tier.lmcache_client import SIDECAR_ENV, LMCacheClient, lmcache_python, sidecar_argv
from stack.kv_tier.lmcache_view import LMCacheLookup, http_lookup
from stack.launch.process import group_members, proc_alive
from stack.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
#: one event loop for every view call (the view's HTTP client belongs to the loop it started on,
#: as in the router, which runs one loop)
LOOP = asyncio.new_event_loop()
CHUNK = 256
PAGE = 64


def _lmc_python() -> str:
    py = lmcache_python()
    if py is None:
        reason = (
            "LMCache's environment is missing (bash .ci/install-lmcache.sh, or set $SMETRIC_LMCACHE_PYTHON)"
        )
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true needs it: {reason}", pytrace=False)
        pytest.skip(reason)
    return py


def _free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def _script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SMETRIC_PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "launch" / name), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _deployment(tmp: Path, py: str) -> tuple[Path, dict]:
    bindir = Path(py).parent
    p = dict(
        zip(
            ["srv", "http", "ctl", "pull", "reply", "rpc", "meta", "metrics", "worker"],
            _free_ports(9),
            strict=True,
        )
    )
    cfg = {
        "model": {"name": "tiny", "path": str(tmp / "model"), "page_size": PAGE},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "run_dir": str(tmp / "run"),
            "kv_tier": "lmcache",
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {"count": 1, "port": p["worker"], "disaggregation": False, "kv_events_port": None},
            "decode": {"count": 0},
            "lmcache": {
                "command": str(bindir / "lmcache"),
                "controller_command": str(bindir / "lmcache_controller"),
                # the PyPI wheel has no Mooncake extension for the MP server's L2 adapter
                "server": {"port": p["srv"], "http_port": p["http"], "l1_size_gb": 0.25, "l2": "none"},
                "controller": {"port": p["ctl"], "pull_port": p["pull"], "reply_port": p["reply"]},
            },
            "mooncake_master": {
                "rpc_port": p["rpc"],
                "http_metadata_port": p["meta"],
                "metrics_port": p["metrics"],
            },
            "router": {"enabled": False},
        },
    }
    path = tmp / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, p


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]


def _assert_gone(recs: list[dict], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [
            r for r in recs if proc_alive(int(r["pid"]), r.get("start_time")) or group_members(int(r["pgid"]))
        ]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: {[r['name'] for r in left]}")


class Sidecars:
    """LMCache engines beside emulated workers, each in its own process group."""

    def __init__(self, py: str, log_dir: Path) -> None:
        self.py, self.log_dir, self.procs = py, log_dir, []

    def start(self, name: str, controller: tuple[str, str], master: str | None) -> LMCacheClient:
        port, wport, mport = _free_ports(3)
        argv = sidecar_argv(
            self.py,
            name,
            port,
            controller=controller,
            worker_port=wport,
            mooncake_master=master,
            mooncake_port=mport,
        )
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**os.environ, **SIDECAR_ENV, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )
        c = LMCacheClient(f"http://127.0.0.1:{port}", timeout_s=30)
        deadline = time.monotonic() + 120
        while not c.healthy():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"sidecar {name} did not start:\n{(self.log_dir / f'{name}.log').read_text()[-3000:]}"
                )
            time.sleep(0.3)
        return c

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)


def _wait_controller(
    view: LMCacheLookup, hashes: list[int], tokens: list[int], want: int, timeout: float = 15.0
) -> int:
    """The view's answer once the controller has heard of the stored chunks (its reports are
    async; a turn's follow-up comes seconds later in an agent loop, here 1 s of settling)."""
    got = -1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view._cache.clear()
        got = LOOP.run_until_complete(view.hit_blocks(hashes, tokens))
        if got >= want:
            break
        time.sleep(0.2)
    settle = time.monotonic() + 1.0  # one store's chunk reports may arrive in a few messages
    while time.monotonic() < settle:
        time.sleep(0.2)
        view._cache.clear()
        got = max(got, LOOP.run_until_complete(view.hit_blocks(hashes, tokens)))
    return got


@pytest.mark.timeout(300)
def test_lmcache_scripts_start_and_stop_on_loopback(tmp_path):
    py = _lmc_python()
    cfg, ports = _deployment(tmp_path, py)
    recs: list[dict] = []
    try:
        for script in ("lmcache-controller.sh", "lmcache-server.sh"):
            up = _script(script, "--config", str(cfg), timeout=150)
            assert up.returncode == 0, up.stderr[-3000:]
        recs = _records(tmp_path / "run")
        assert sorted(r["name"] for r in recs) == ["lmcache-controller", "lmcache-server"]
        st = _script("lmcache-server.sh", "status", "--config", str(cfg))
        assert st.returncode == 0 and "ready" in st.stdout, st.stdout
        # the real MP server answers its HTTP API with the chunk size the launcher gave it
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/healthcheck", timeout=5) as r:
            assert r.status == 200
        for script in ("lmcache-server.sh", "lmcache-controller.sh"):
            down = _script(script, "stop", "--config", str(cfg))
            assert down.returncode == 0 and "stopped 1" in down.stdout, down.stdout
        _assert_gone(recs)
    finally:
        from stack.launch.process import stop_groups

        stop_groups(recs, None, grace_s=2)


@pytest.mark.timeout(600)
def test_migrated_follow_up_through_lmcache_and_the_routers_prediction(tmp_path):
    if shutil.which("mooncake_master") is None:
        pytest.skip("mooncake_master not installed (.ci/install-system.sh)")
    py = _lmc_python()
    cfg, ports = _deployment(tmp_path, py)
    recs: list[dict] = []
    side = Sidecars(py, tmp_path)
    try:
        for script in ("mooncake-master.sh", "lmcache-controller.sh"):
            up = _script(script, "--config", str(cfg), timeout=150)
            assert up.returncode == 0, up.stderr[-3000:]
        recs = _records(tmp_path / "run")
        ctl = (f"127.0.0.1:{ports['pull']}", f"127.0.0.1:{ports['reply']}")
        master = f"127.0.0.1:{ports['rpc']}"
        a = side.start("prefill-0", ctl, master)
        b = side.start("prefill-1", ctl, master)

        rng = random.Random(7)
        prompt = [rng.randrange(1, 30000) for _ in range(1000)]
        kv = bytes(rng.randrange(256) for _ in range(len(prompt) * 16))
        assert a.store(prompt, kv) == 768  # three whole chunks; the partial fourth is not kept
        assert a.lookup(prompt) == 768

        # the follow-up turn: the prompt plus the answer and a new user message, sent to B
        follow = prompt + [rng.randrange(1, 30000) for _ in range(300)]
        hashes = list(range(len(follow) // PAGE))
        view = LMCacheLookup(
            http_lookup(f"http://127.0.0.1:{ports['ctl']}"),
            block_size=PAGE,
            chunk_size=CHUNK,
            timeout_s=2.0,
            fallback=WrittenIndex(),
        )
        predicted = _wait_controller(view, hashes, follow, want=1) * PAGE
        got = b.retrieve(follow)  # B never saw this prompt: the KV comes from the Mooncake store
        assert got.hit_tokens == 768
        assert got.kv == kv[: 768 * 16]
        assert abs(predicted - got.hit_tokens) <= CHUNK, (predicted, got.hit_tokens)
        assert view.answered >= 1 and view.errors == 0
        # control: an engine without the Mooncake store behind it finds nothing, so B's hit
        # came through the store (the one thing A and B share besides the controller)
        c = side.start("prefill-2", ctl, None)
        assert c.retrieve(follow).hit_tokens == 0

        # a prompt no one holds: predicted and reported 0
        other = [rng.randrange(1, 30000) for _ in range(600)]
        view._cache.clear()
        assert LOOP.run_until_complete(view.hit_blocks(list(range(len(other) // PAGE)), other)) == 0
        assert b.retrieve(other).hit_tokens == 0

        # the controller goes down: the view answers from the router's own index, in time
        down = _script("lmcache-controller.sh", "stop", "--config", str(cfg))
        assert down.returncode == 0, down.stdout
        view.fallback.record_written(hashes[:4])
        view._cache.clear()
        t0 = time.monotonic()
        assert LOOP.run_until_complete(view.hit_blocks(hashes, follow)) == 4
        assert time.monotonic() - t0 < 2.5 and view.errors + view.timeouts >= 1
    finally:
        side.close()
        for script in ("lmcache-controller.sh", "mooncake-master.sh"):
            _script(script, "stop", "--config", str(cfg))
        from stack.launch.process import stop_groups

        stop_groups(recs, None, grace_s=2)
    _assert_gone(recs)
    assert all(p.poll() is not None for p in side.procs)


@pytest.mark.timeout(600)
def test_local_stack_with_lmcache_smetric_up(tmp_path):
    """`smetric up --config configs/local-lmcache.yaml`: the emulated PD stack with a real
    LMCache engine per prefill worker and the controller; a request through the router; a
    follow-up on the other prefill worker gets its prefix through LMCache (Mooncake) and counts
    it as a global hit; the router's LMCache view predicts that hit within one chunk."""
    if shutil.which("mooncake_master") is None:
        pytest.skip("mooncake_master not installed (.ci/install-system.sh)")
    _lmc_python()
    from stack.launch.loopback import client

    cfg = yaml.safe_load((ROOT / "configs" / "local-lmcache.yaml").read_text())
    cfg["launch"]["ports"] = "auto"
    run_dir = tmp_path / "run"
    path = tmp_path / "local-lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    smetric = [sys.executable, "-m", "stack.cli"]
    up = subprocess.run(
        [*smetric, "up", "--config", str(path), "--run-dir", str(run_dir), "--detach"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    recs = _records(run_dir)
    try:
        assert up.returncode == 0, up.stderr[-4000:]
        info = json.loads(up.stdout.strip().splitlines()[-1])
        roles = sorted(r["role"] for r in recs)
        assert roles.count("lmcache_server") == 2 and roles.count("lmcache_controller") == 1
        rcfg = yaml.safe_load((run_dir / "router-config.yaml").read_text())["router"]
        assert rcfg["global_tier"] == "lmcache"
        # the PD path through the router, with LMCache as the prefill workers' global tier
        model = client().get(info["router_url"] + "/v1/models").json()["data"][0]["id"]  # the served name
        body = {"model": model, "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 5}
        resp = client().post(info["router_url"] + "/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        # turn 1 on prefill-0, its follow-up migrated to prefill-1 (each a whole request there)
        rng = random.Random(11)
        turn1 = [rng.randrange(100, 900) for _ in range(1400)]
        follow = turn1 + [rng.randrange(100, 900) for _ in range(500)]
        p0, p1 = info["prefill"][0], info["prefill"][1]
        gen = {"sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        r1 = client().post(p0 + "/generate", json={"input_ids": turn1, **gen})
        assert r1.status_code == 200, r1.text
        view = LMCacheLookup(
            http_lookup(rcfg["lmcache_controller_url"]), block_size=PAGE, chunk_size=CHUNK, timeout_s=2.0
        )
        predicted = _wait_controller(view, list(range(len(follow) // PAGE)), follow, want=1) * PAGE
        r2 = client().post(p1 + "/generate", json={"input_ids": follow, **gen})
        assert r2.status_code == 200, r2.text
        meta = r2.json()["meta_info"]
        assert meta["cached_tokens_local"] == 0
        assert meta["cached_tokens_global"] == 1280  # five whole chunks of turn 1's 1400 tokens
        assert abs(predicted - meta["cached_tokens_global"]) <= CHUNK, (predicted, meta)
    finally:
        d = subprocess.run(
            [*smetric, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120
        )
    assert d.returncode == 0, d.stdout + d.stderr
    _assert_gone(recs)
