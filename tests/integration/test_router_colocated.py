"""The router without PD: one colocated pool (no decode list, no bootstrap fields), the
policies seeing each worker's running decodes through the view both drivers fill."""

from __future__ import annotations

import threading

import pytest

from stack.config import parse_config
from stack.core.cost_model import load_hardware
from stack.models.tiny import build_tiny_model
from stack.pool import WorkerRegistry
from stack.prefill_router.view import build_view
from support.router_harness import Cluster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_cluster(model_dir):
    made = []

    def make(**kw):
        c = Cluster(model_dir, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_mode_auto_is_colocated_without_decode_workers():
    assert parse_config({"prefill": [{"url": "http://127.0.0.1:1"}]}).colocated
    pd = {"prefill": [{"url": "http://127.0.0.1:1"}], "decode": [{"url": "http://127.0.0.1:2"}]}
    assert not parse_config(pd).colocated
    assert parse_config({"router": {"mode": "colocated"}}).colocated
    with pytest.raises(Exception, match="colocated takes no decode"):
        parse_config({**pd, "router": {"mode": "colocated"}})


def test_a_colocated_booking_stays_on_its_worker_as_a_decode_until_it_ends():
    reg = WorkerRegistry(eject_cooldown_s=0)
    w = reg.add("prefill", "http://127.0.0.1:1")
    b = reg.book(w, 1000, 0.5, prompt_tokens=3000)
    dc = load_hardware("h20").decode
    view = lambda: build_view(  # noqa: E731
        0.0, [w], {}, 0, prompt_tokens=10, block_size=64, fetch_tokens_per_s=0, sec_per_token=1e-5, decode=dc
    ).instances[0]
    s = view()
    assert (s.running, s.decode_running, s.queued_tokens) == (1, 0, 1000)
    assert b.prefill_done()
    s = view()
    assert (s.running, s.decode_running, s.decode_tokens, s.queued_tokens) == (1, 1, 3000, 0)
    assert s.decode_step_s == pytest.approx(dc.mixed_extra(1, 3000, 1e-5)) and s.decode_step_s > 0
    b.release()
    s = view()
    assert (s.running, s.decode_running, s.decode_step_s) == (0, 0, 0.0)
    # under PD (a decode worker in the booking) nothing decodes on the prefill worker
    d = reg.add("decode", "http://127.0.0.1:2")
    b = reg.book(w, 1000, 0.5, decode=d, prompt_tokens=3000)
    b.prefill_done()
    assert not w.decoding and view().decode_running == 0


def test_router_serves_a_colocated_pool_and_routes_around_a_running_decode(make_cluster):
    # no load polls: what the second request sees is the router's own accounting
    c = make_cluster(
        n_prefill=2,
        n_decode=0,
        policy="least-load",
        router={"load_poll": False, "dispatch": {"order": "immediate"}},
        prefill_kw={"tokens": 40, "chunk_delay_s": 0.05},
    )
    assert c.state.colocated and c.state.routing.decode_cost is not None
    first = threading.Event()
    done: dict = {}

    def long_stream():
        with c.client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a " * 50}], "stream": True},
        ) as s:
            it = s.iter_raw()
            chunks = [next(it)]
            first.set()
            chunks.extend(it)
        done["body"] = b"".join(chunks)

    t = threading.Thread(target=long_stream)
    t.start()
    assert first.wait(10)
    ws = c.prefill_workers()
    c.wait_for(lambda: sum(len(w.decoding) for w in ws) == 1)
    busy = next(w for w in ws if w.decoding)
    r = c.client.post("/v1/completions", json={"prompt": "b " * 50, "max_tokens": 4})
    assert r.status_code == 200
    t.join(15)
    assert b"[DONE]" in done["body"]
    # the first request decoded on one worker; the second went to the other one
    busy_fake = next(f for f, s in zip(c.prefill, c.servers) if s.url == busy.url)
    other_fake = next(f for f in c.prefill if f is not busy_fake)
    assert [p for p, _, _ in busy_fake.records] == ["/v1/chat/completions"]
    assert [p for p, _, _ in other_fake.records] == ["/v1/completions"]
    assert all("bootstrap_room" not in body for f in c.prefill for _, body, _ in f.records)
    c.wait_for(lambda: not any(w.decoding for w in ws) and all(w.inflight == 0 for w in ws))


@pytest.mark.timeout(150)
@pytest.mark.mooncake
def test_smetric_up_serves_the_local_colocated_config_and_down_leaves_nothing(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from stack.launch.loopback import client, mooncake_skip_reason
    from stack.launch.process import proc_alive

    if (why := mooncake_skip_reason()) is not None:
        pytest.skip(why)
    cfg = Path(__file__).resolve().parents[2] / "configs" / "local-colocated.yaml"
    run_dir = tmp_path / "run"
    smetric = [sys.executable, "-m", "stack.cli"]
    dry = subprocess.run(
        [*smetric, "up", "--config", str(cfg), "--ports", "auto", "--run-dir", str(run_dir), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("--mode colocated") == 4 and "--mode prefill" not in dry.stdout
    assert "--mode decode" not in dry.stdout
    up = subprocess.run(
        [
            *smetric,
            "up",
            "--config",
            str(cfg),
            "--prefill",
            "2",
            "--ports",
            "auto",
            "--run-dir",
            str(run_dir),
            "--detach",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    recs = [json.loads(f.read_text()) for f in (run_dir / "pids").glob("*.json")]
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        info = json.loads(up.stdout.strip().splitlines()[-1])
        assert len(info["prefill"]) == 2 and info["decode"] == []
        assert {x["role"] for x in recs} == {"mooncake_master", "prefill", "router"}
        c = client()
        model = c.get(info["router_url"] + "/v1/models").json()["data"][0]["id"]  # the served name
        msgs = [{"role": "user", "content": "fix the failing test in module_7.py " * 40}]
        r = c.post(
            info["router_url"] + "/v1/chat/completions",
            json={"model": model, "messages": msgs, "max_tokens": 6},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        with c.stream(
            "POST",
            info["router_url"] + "/v1/chat/completions",
            json={"model": model, "messages": msgs, "max_tokens": 6, "stream": True},
        ) as s:
            assert s.status_code == 200 and b"[DONE]" in b"".join(s.iter_raw())
        cfgd = c.get(info["router_url"] + "/model_info").json()
        assert cfgd  # the router answers SGLang's /model_info in front of a colocated pool
    finally:
        down = subprocess.run(
            [*smetric, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0, down.stderr
    assert not any(proc_alive(x["pid"], x["start_time"]) for x in recs)
