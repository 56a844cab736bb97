"""router.time_factor: the router's clock runs in the pool's seconds (the SLO's and the cost
model's), so a dispatch queue in front of an emulated pool at time factor f ages, orders and
expires its requests as the simulator does; `smetric up` copies the emulator's factor."""

from __future__ import annotations

import time

import pytest
import yaml

from stack.config import parse_config
from stack.launch import emulated
from stack.launch.cli import default_config
from stack.models.tiny import build_tiny_model
from stack.prefill_router.state import RouterState, pool_clock


def _cfg(tmp_path, **router):
    model_dir = build_tiny_model(tmp_path / "tiny")
    return parse_config(
        {
            "model": {"name": "tiny", "path": str(model_dir), "page_size": 16},
            "router": {"dispatch": {"order": "slack"}, **router},
            "prefill": [{"url": "http://127.0.0.1:9", "bootstrap_port": 1}],
            "decode": [{"url": "http://127.0.0.1:10"}],
        }
    )


def test_pool_clock_divides_wall_time_by_the_factor():
    assert pool_clock(1.0) is time.monotonic
    clock = pool_clock(0.25)
    w0, c0 = time.monotonic(), clock()
    assert c0 == pytest.approx(w0 / 0.25, abs=0.05)
    time.sleep(0.05)
    assert clock() - c0 == pytest.approx(0.05 / 0.25, rel=0.5)


def test_the_dispatch_queue_reads_the_pool_clock(tmp_path):
    st = RouterState(_cfg(tmp_path, time_factor=0.5))
    assert st.time_factor == 0.5
    assert st.queue.clock() == pytest.approx(time.monotonic() / 0.5, abs=0.05)
    real = RouterState(_cfg(tmp_path))  # a real engine: wall seconds
    assert real.queue.clock is time.monotonic


def test_time_factor_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="time_factor"):
        _cfg(tmp_path, time_factor=0)


def test_smetric_up_gives_the_router_the_emulators_time_factor():
    cfg = yaml.safe_load(default_config().read_text())
    tf = cfg["launch"]["emulator"]["time_factor"]
    rc = emulated.resolved_config(cfg, emulated.plan(cfg))["router"]
    assert rc["time_factor"] == tf
    cfg["router"] = {**cfg.get("router", {}), "time_factor": 1.0}  # an explicit setting wins
    assert emulated.resolved_config(cfg, emulated.plan(cfg))["router"]["time_factor"] == 1.0
