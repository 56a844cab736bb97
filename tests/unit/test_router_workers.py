"""Worker registry: dispatch accounting, reconciliation with polled loads, ejection."""

from __future__ import annotations

import time

import pytest

from stack.config import load_config, parse_config
from stack.pool import WorkerRegistry

pytestmark = pytest.mark.timeout(30)


def test_accounting_and_reconciliation():
    reg = WorkerRegistry(eject_cooldown_s=0.0)
    w = reg.add("prefill", "http://h:1/", bootstrap_port=8998)
    assert w.url == "http://h:1" and w.host == "h"
    t1 = reg.charge(w, 1000, 0.5)
    t2 = reg.charge(w, 3000, 1.5)
    now = time.monotonic()
    assert w.view_queued(10, now, 1e-4) == (4000, 2.0)
    assert w.view_running(10, now) == 2
    reg.prefill_done(w, t1)
    reg.prefill_done(w, t1)  # idempotent
    assert (w.queued_tokens, w.queued_seconds, w.view_running(10, now)) == (3000, 1.5, 1)
    # the worker says 4 are waiting, the router knows 1: 3 unknown charged at the mean size
    w.polled_waiting, w.polled_running, w.polled_at = 4, 1, time.monotonic()
    qt, qs = w.view_queued(10, time.monotonic(), 1e-4)
    assert qt > 3000 and qs > 1.5
    assert w.view_running(10, time.monotonic()) == 5
    # stale polls are ignored
    assert w.view_queued(10, time.monotonic() + 60, 1e-4) == (3000, 1.5)
    reg.finished(w, t2)
    reg.finished(w, t1)
    assert (w.queued_tokens, w.inflight) == (0, 0)
    with pytest.raises(ValueError):
        reg.add("prefill", "http://h:1")
    with pytest.raises(ValueError):
        reg.add("router", "http://x:1")


def test_purge_stale_tickets():
    reg = WorkerRegistry()
    w = reg.add("prefill", "http://h:1")
    reg.charge(w, 10, 0.1)
    reg.purge_stale(max_age_s=0.0)
    assert w.queued_tokens == 0 and not w.queued


def test_ejection_threshold_and_cooldown():
    reg = WorkerRegistry(eject_cooldown_s=0.2)
    w = reg.add("decode", "http://d:1")
    ejected, readmitted = [], []
    reg.on_eject.append(ejected.append)
    reg.on_readmit.append(readmitted.append)
    reg.mark_failed(w, threshold=2)
    assert w.healthy
    reg.mark_failed(w, threshold=2)
    assert not w.healthy and ejected == [w]
    reg.mark_ok(w)  # too early
    assert not w.healthy
    time.sleep(0.25)
    reg.mark_ok(w)
    assert w.healthy and readmitted == [w]
    reg.mark_failed(w, threshold=5, immediate=True)
    assert not w.healthy


def test_config_schema_and_example(tmp_path):
    cfg = load_config("configs/router-example.yaml")
    assert cfg.router.host == "127.0.0.1" and cfg.prefill[0].kv_events.startswith("tcp://")
    d = parse_config({"launch": {"anything": [1, 2]}, "router": {}, "other_section": {}})
    assert d.router.port == 8000 and d.router.host == "127.0.0.1" and d.launch == {"anything": [1, 2]}
    with pytest.raises(ValueError, match="router.extra_knob: unknown key"):  # the router's keys are strict
        parse_config({"router": {"extra_knob": 1}})
    with pytest.raises(ValueError) as e:
        parse_config({"prefill": [{"url": "ftp://x"}], "model": {"page_size": 0}})
    assert "prefill.0.url" in str(e.value) and "model.page_size" in str(e.value)
    (tmp_path / "bad.yaml").write_text("router: [\n")
    with pytest.raises(ValueError):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")


def test_computed_seconds_drain_first_come_first_served():
    """A worker's bookings drain one after the other from when each was booked (the compute
    the dispatch queue's readiness no longer counts), in the pool's seconds."""
    from stack.pool import WorkerRegistry

    reg = WorkerRegistry(5.0)
    w = reg.add("prefill", "http://127.0.0.1:9")
    assert w.computed_seconds(100.0) == 0.0
    for t0, secs in ((100.0, 2.0), (100.5, 3.0), (110.0, 1.0)):
        t = reg.charge(w, 1000, secs)
        w.queued[t].t0 = t0  # as if booked at t0 (wall)
    assert w.queued_seconds == 6.0
    assert w.computed_seconds(100.0) == 0.0
    assert w.computed_seconds(101.0) == 1.0  # the first is half done
    assert w.computed_seconds(104.0) == 4.0  # the first done at 102, the second 2 of 3 s in
    assert w.computed_seconds(109.0) == 5.0  # both done; the third not booked yet (drains from 110)
    assert w.computed_seconds(110.5) == 5.5
    assert w.computed_seconds(200.0) == 6.0  # never more than booked
    # time factor 0.5: a wall second is two seconds of the pool: at wall 101.5 (pool 203) the
    # first (pool 200-202) is done and the second (pool 202-205) 1 s in
    assert w.computed_seconds(101.5, time_factor=0.5) == 3.0
