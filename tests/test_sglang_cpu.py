"""CPU integration tier: real SGLang prefill + decode workers behind our router.

Selected with `pytest -m sglang`; skipped (with the reason) when no interpreter has sglang —
`bash .ci/install-sglang.sh` installs it into /opt/sglang-venv (see docs/deploy.md).

What runs: a tiny random-weight Llama built here (tests/sglang_cpu/build_tiny_llama.py, no hub);
two real SGLang prefill workers and one decode worker over `mooncake_tcp`, KV events on, started
from the very ProcessSpecs `stack.launch.sglang` builds for `launch.device: cpu`; one plain
(non-disaggregated) SGLang worker as the reference; `smetric router` in front, reading the
router config that `resolved_config` derives. The test-only sgl_kernel stand-in
(tests/sglang_cpu/shim) is put on the workers' PYTHONPATH.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sglang_cpu"))
from _locate import sglang_python, skip_reason  # noqa: E402

pytestmark = pytest.mark.sglang

ADMIN = "sglang-tier-admin-token"
PAGE = 16


def _require_sglang() -> str:
    py = sglang_python()
    if py is None:
        pytest.skip(skip_reason())
    r = subprocess.run(
        [py, "-c", "import mooncake.engine, transformers, torch"], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"sglang found at {py} but not the CPU-tier extras (run .ci/install-sglang.sh without --args): {r.stderr[-300:]}"
        )
    return py


@pytest.fixture(scope="module")
def sg_python() -> str:
    return _require_sglang()


@pytest.fixture(scope="module")
def tiny_model(sg_python, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run(
        [sg_python, str(HERE / "sglang_cpu" / "build_tiny_llama.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def tier_config(py: str, model: Path, run_dir: Path, ports: dict) -> dict:
    return {
        "model": {"name": "tiny", "path": str(model), "page_size": PAGE, "context_length": 4096},
        "router": {
            "host": "127.0.0.1",
            "port": ports["router"],
            "policy": "smetric",
            "health_interval_s": 1.0,
            # SGLang's /health generates a token: on a busy 2-core machine a CPU worker can take
            # many seconds to answer it, and ejecting it for that turned requests into 503s.
            "health_timeout_s": 30.0,
            "health_failures": 5,
            "admin_token_env": "SMETRIC_TIER_ADMIN",
        },
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": py,
            "run_dir": str(run_dir),
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 2,
                "port": ports["prefill"],
                "bootstrap_port": ports["bootstrap"],
                "kv_events_port": ports["kv"],
                "port_stride": 1,
                "transfer_backend": "mooncake_tcp",
            },
            "decode": {
                "count": 1,
                "port": ports["decode"],
                "port_stride": 1,
                "transfer_backend": "mooncake_tcp",
            },
            "mooncake_master": None,
            "router": {"command": [sys.executable, "-m", "stack.cli"], "node": "local"},
        },
    }


def single_config(cfg: dict, port: int) -> dict:
    """A plain (non-disaggregated) worker with the same model and flags: the reference."""
    c = copy.deepcopy(cfg)
    c["launch"]["prefill"] = {"count": 1, "port": port, "disaggregation": False, "kv_events_port": None}
    c["launch"]["decode"] = {"count": 0}
    c["launch"]["router"] = False
    return c


@pytest.fixture(scope="module")
def stack_up(sg_python, tiny_model, tmp_path_factory):
    from harness import free_port, start, stop_all, wait_ready

    from stack.launch.sglang import resolved_config, router_config_path, sglang_process_specs

    run_dir = tmp_path_factory.mktemp("sglang-run")
    base = free_port()
    ports = {
        "router": free_port(),
        "prefill": 20000 + base % 5000,
        "bootstrap": 26000 + base % 5000,
        "kv": 32000 + base % 5000,
        "decode": 38000 + base % 5000,
        "single": 44000 + base % 5000,
    }
    cfg = tier_config(sg_python, tiny_model, run_dir, ports)
    specs = sglang_process_specs(cfg)
    single = [s for s in sglang_process_specs(single_config(cfg, ports["single"]))]
    for s in single:
        s.name = "single-0"
    path = Path(router_config_path(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(resolved_config(cfg), sort_keys=False))
    logs = run_dir / "logs"
    workers = [s for s in specs if s.role in ("prefill", "decode")] + single
    for s in workers:  # four CPU workers on two cores: one compute thread each, no oversubscription
        s.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    t0 = time.monotonic()
    procs = [start(s, logs) for s in workers]
    router = None
    try:
        wait_ready(procs, timeout=420)
        startup_s = time.monotonic() - t0
        rspec = next(s for s in specs if s.role == "router")
        router = start(rspec, logs, {"SMETRIC_TIER_ADMIN": ADMIN})
        wait_ready([router], timeout=60)
        _wait_router_workers(f"http://127.0.0.1:{ports['router']}", 3)
        yield {
            "cfg": cfg,
            "specs": specs,
            "ports": ports,
            "router": f"http://127.0.0.1:{ports['router']}",
            "prefill": [f"http://127.0.0.1:{ports['prefill'] + i}" for i in range(2)],
            "decode": f"http://127.0.0.1:{ports['decode']}",
            "single": f"http://127.0.0.1:{ports['single']}",
            "startup_s": startup_s,
            "procs": procs,
            "logs": logs,
        }
    finally:
        stop_all(([router] if router else []) + procs)


def _get(url: str, headers: dict | None = None, timeout: float = 10) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 300) -> dict:  # CPU workers on a busy 2-core box
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _workers(router: str) -> list[dict]:
    return _get(router + "/admin/workers", {"authorization": f"Bearer {ADMIN}"})["workers"]


def _wait_router_workers(router: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if sum(w["healthy"] for w in _workers(router)) >= n:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"router did not see {n} healthy workers: {_workers(router)}")


PROMPT = (
    "You are a helpful coding agent. Read the file, fix the bug, run the tests. "
    "def main(argv):\n    return run(parse(argv))\n" * 4
)


def test_startup_time_recorded(stack_up):
    # the issue budgets under a minute per worker; 4 workers (2 P, 1 D, 1 plain) start together on 2 cores
    print(f"\n4 SGLang CPU workers ready in {stack_up['startup_s']:.0f} s")
    assert stack_up["startup_s"] < 420


def test_chat_completion_through_router(stack_up):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = _post(stack_up["router"] + "/v1/chat/completions", body)
    assert r["object"] == "chat.completion"
    assert r["usage"]["completion_tokens"] >= 1
    assert isinstance(r["choices"][0]["message"]["content"], str)


def test_streamed_chat_completion_through_router(stack_up):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT + " stream"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        stack_up["router"] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            if line == "data: [DONE]":
                break
    assert chunks, "no SSE chunks"
    text = "".join(
        (c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices")
    )
    assert chunks[-1]["choices"][0].get("finish_reason") in ("length", "stop") or text


def test_pd_tokens_equal_single_worker(stack_up):
    """Greedy decode through P->D (KV over mooncake_tcp) equals one plain worker token for token."""
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = PROMPT + " session turn prefix cache"
    ref = _post(stack_up["single"] + "/generate", {"text": text, "sampling_params": sp})
    got = _post(stack_up["router"] + "/generate", {"text": text, "sampling_params": sp})
    assert got["output_ids"] == ref["output_ids"], (got, ref)
    # and the same directly against the pair (our router out of the loop)
    body = {
        "text": text,
        "sampling_params": sp,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": stack_up["ports"]["bootstrap"],
        "bootstrap_room": random.randrange(2**63),
    }
    res = {}
    t = threading.Thread(
        target=lambda: res.__setitem__("p", _post(stack_up["prefill"][0] + "/generate", body))
    )
    t.start()
    d = _post(stack_up["decode"] + "/generate", body)
    t.join()
    assert d["output_ids"] == ref["output_ids"]


def test_router_index_fed_by_real_kv_events(stack_up):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT + " events"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    _post(stack_up["router"] + "/v1/chat/completions", body)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        ws = [w for w in _workers(stack_up["router"]) if w["role"] == "prefill"]
        if any(w.get("index_blocks", 0) > 0 and w.get("kv_source") == "events" for w in ws):
            break
        time.sleep(0.5)
    assert any(w.get("kv_source") == "events" for w in ws), ws
    assert sum(w.get("index_blocks", 0) for w in ws) > 0, ws


def test_kv_events_wire_format_from_real_worker(stack_up):
    """Subscribe to a real prefill worker directly and decode with stack.kv_tier.events."""
    import zmq

    from stack.kv_tier.events import BlockStored, decode_payload

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{stack_up['ports']['kv'] + 1}")
    time.sleep(0.5)  # slow joiner
    try:
        text = PROMPT + " direct subscriber " * 8
        sp = {"max_new_tokens": 1, "temperature": 0}
        # a plain request to a PD prefill worker needs a decode twin: send the pair directly
        body = {
            "text": text,
            "sampling_params": sp,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": stack_up["ports"]["bootstrap"] + 1,
            "bootstrap_room": random.randrange(2**63),
        }
        t = threading.Thread(target=lambda: _post(stack_up["prefill"][1] + "/generate", body))
        t.start()
        _post(stack_up["decode"] + "/generate", body)
        t.join()
        stored = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not stored:
            if poller.poll(500):
                parts = sub.recv_multipart()
                batch = decode_payload(parts[-1])
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored, "no BlockStored event from the real prefill worker"
        assert all(e.block_size == PAGE for e in stored)
    finally:
        sub.close(0)


def test_follow_up_goes_to_prefix_holder(stack_up):
    router = stack_up["router"]

    def dispatched() -> dict:
        return {w["url"]: w["dispatched"] for w in _workers(router) if w["role"] == "prefill"}

    sys_msg = {"role": "system", "content": "You are a helpful coding agent. " * 12}
    turn1 = [sys_msg, {"role": "user", "content": "Read the file, fix the bug, run the tests. " * 10}]
    before = dispatched()
    r1 = _post(
        router + "/v1/chat/completions",
        {"model": "tiny", "messages": turn1, "max_tokens": 4, "temperature": 0},
    )
    mid = dispatched()
    first = [u for u in mid if mid[u] > before.get(u, 0)]
    assert len(first) == 1
    time.sleep(1.0)  # let the KV events of turn 1 land in the router's index
    turn2 = turn1 + [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"] or "ok"},
        {"role": "user", "content": "Now run the tests again."},
    ]
    _post(
        router + "/v1/chat/completions",
        {"model": "tiny", "messages": turn2, "max_tokens": 4, "temperature": 0},
    )
    after = dispatched()
    second = [u for u in after if after[u] > mid.get(u, 0)]
    assert second == first, (before, mid, after)


def test_real_sglang_router_in_front_of_the_same_pair(stack_up, sg_python):
    """Cross-check of our PD hand-off: the real sglang-router gives the same greedy tokens."""
    from harness import free_port

    r = subprocess.run([sg_python, "-c", "import sglang_router"], capture_output=True)
    if r.returncode != 0:
        pytest.skip(
            "sglang-router is not installed in the sglang interpreter (.ci/install-sglang.sh installs it)"
        )
    port = free_port()
    bp = stack_up["ports"]["bootstrap"]
    argv = [
        sg_python,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        stack_up["prefill"][0],
        str(bp),
        "--prefill",
        stack_up["prefill"][1],
        str(bp + 1),
        "--decode",
        stack_up["decode"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill-policy",
        "cache_aware",
        # as for our router: SGLang's /health generates a token, slow on busy CPU workers, and
        # sglang-router's default timeout ejected both prefill workers (503 "No prefill workers")
        "--health-check-timeout-secs",
        "30",
        "--health-failure-threshold",
        "5",
    ]
    log = open(stack_up["logs"] / "sglang-router.log", "wb")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise AssertionError(
                        (stack_up["logs"] / "sglang-router.log").read_text()[-3000:]
                    ) from None
                time.sleep(0.5)
        sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        text = PROMPT + " cross-check with sglang-router"
        ref = _post(stack_up["single"] + "/generate", {"text": text, "sampling_params": sp})
        theirs = _post(f"http://127.0.0.1:{port}/generate", {"text": text, "sampling_params": sp})
        ours = _post(stack_up["router"] + "/generate", {"text": text, "sampling_params": sp})
        assert theirs["output_ids"] == ref["output_ids"] == ours["output_ids"]
    finally:
        import os as _os
        import signal as _signal

        try:
            _os.killpg(p.pid, _signal.SIGTERM)
            p.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            _os.killpg(p.pid, _signal.SIGKILL)
        log.close()


# ---------------------------------------------------------------------------------------------
# HiCache: device -> host -> Mooncake store, against a real mooncake_master

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def _words(seed: int, n: int = 60) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) + str(r.randrange(100)) for _ in range(n))


@pytest.fixture(scope="module")
def hicache_pair(sg_python, tiny_model, tmp_path_factory):
    """A PD pair whose prefill worker runs HiCache with the Mooncake store, as in production.

    Prefill: `--enable-hierarchical-cache --hicache-ratio 2 --hicache-io-backend direct
    --hicache-storage-backend mooncake`, KV events on, device pool 1024 tokens (host pool 2x),
    a 256 MiB Mooncake store behind a real mooncake_master; decode over mooncake_tcp. The prefill
    needs the test-only HiCache CPU patch (tests/sglang_cpu/shim/sitecustomize.py).
    """
    from harness import free_port, start, stop_all, wait_ready

    from stack.launch.sglang import sglang_process_specs

    master_bin = Path(sg_python).parent / "mooncake_master"
    if not master_bin.exists():
        pytest.skip(f"no mooncake_master next to {sg_python} (mooncake-transfer-engine-non-cuda)")
    run_dir = tmp_path_factory.mktemp("hicache-run")
    cfg = {
        "model": {"name": "tiny", "path": str(tiny_model), "page_size": PAGE, "context_length": 4096},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "python": sg_python,
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 1,
                "port": free_port(),
                "bootstrap_port": free_port(),
                "kv_events_port": free_port(),
                "transfer_backend": "mooncake_tcp",
                "max_total_tokens": 1024,
                "hicache": {"ratio": 2, "storage_backend": "mooncake"},
                "extra_args": ["--enable-cache-report"],
            },
            "decode": {"count": 1, "port": free_port(), "transfer_backend": "mooncake_tcp"},
            "mooncake_master": {
                "binary": str(master_bin),
                "rpc_port": free_port(),
                "http_metadata_port": None,
                "metrics_port": free_port(),
            },
            "mooncake_store": {"global_segment_size": 256 * 1024 * 1024},
            "router": False,
        },
    }
    specs = sglang_process_specs(cfg)
    assert [s.role for s in specs] == ["mooncake_master", "prefill", "decode"]
    logs = run_dir / "logs"
    procs = []
    try:
        procs.append(start(specs[0], logs))
        wait_ready(procs, timeout=30)
        procs += [start(s, logs, {"SMETRIC_TEST_HICACHE_CPU_PATCH": "1"}) for s in specs[1:]]
        wait_ready(procs, timeout=300)
        pool = cfg["launch"]
        yield {
            "prefill": f"http://127.0.0.1:{pool['prefill']['port']}",
            "decode": f"http://127.0.0.1:{pool['decode']['port']}",
            "bootstrap_port": pool["prefill"]["bootstrap_port"],
            "logs": logs,
        }
    finally:
        stop_all(procs[::-1])


def test_hicache_prompt_comes_back_from_mooncake_store(hicache_pair):
    """Pushed out of device and host memory, a prompt's KV comes back from the Mooncake store
    on the prefill worker, crosses to the decode worker, and decodes to the same tokens."""

    def pd(text: str, n: int = 1) -> tuple[dict, dict]:
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": hicache_pair["bootstrap_port"],
            "bootstrap_room": random.randrange(2**63),
        }
        res = {}
        t = threading.Thread(
            target=lambda: res.__setitem__("p", _post(hicache_pair["prefill"] + "/generate", body))
        )
        t.start()
        d = _post(hicache_pair["decode"] + "/generate", body)
        t.join()
        return res["p"], d

    a = _words(0)
    _, first = pd(a, 8)
    p_again, _ = pd(a, 8)
    assert p_again["meta_info"]["cached_tokens_details"]["device"] > 0
    # push A out of device (1024 tokens) and host (2048 tokens) memory: ~14k tokens of others
    for i in range(1, 40):
        pd(_words(i))
    time.sleep(2.0)
    p_back, back = pd(a, 8)
    d = p_back["meta_info"]["cached_tokens_details"]
    assert d["storage_backend"] == "MooncakeStore"
    assert d["device"] == 0 and d["host"] == 0, d
    assert d["storage"] >= PAGE * ((p_back["meta_info"]["prompt_tokens"] - 1) // PAGE) - PAGE, d
    # the KV that came back from the store is the right KV: same greedy tokens on decode
    assert back["output_ids"] == first["output_ids"]
