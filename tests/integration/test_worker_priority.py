"""The emulated worker honours SGLang's priority scheduling over HTTP: with
``--enable-priority-scheduling --disable-priority-preemption`` its waiting requests start by
``priority`` (highest first; none: last), then by arrival; without the flag, by arrival; a
running request is never preempted; a bad priority is a 400."""

from __future__ import annotations

import threading
import time

import pytest

from stack.launch.loopback import Procs, client

pytestmark = pytest.mark.timeout(180)
CHUNK = 64


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("prio-logs")) as p:
        yield p


def _worker(procs: Procs, **flags):
    # one token budget per step of 64 tokens, each step ~30 ms of real time: a 3000-token
    # request keeps the worker busy for about 1.5 s while the others queue
    return procs.worker(
        "prefill", page_size=16, chunk_tokens=CHUNK, time_factor=1.0, enable_metrics=True, **flags
    )


def _post(url: str, ids: list[int], prio: int | None, out: dict, key: str) -> None:
    body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
    if prio is not None:
        body["priority"] = prio
    r = client().post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out[key] = r.json()["meta_info"]["forward_entry_time"]


def _load(url: str, key: str) -> int:
    return client().get(url + "/v1/loads").json()["loads"][0][key]


def _start_order(url: str, prios: list[int | None]) -> list[str]:
    """Occupy the worker with a long request, queue one 100-token request per priority
    (in the order given, 50 ms apart), and return their keys in the order they started."""
    out: dict[str, float] = {}
    base = 1000 + int(time.time() * 1000) % 100_000 * 50  # fresh tokens: no prefix hit
    blocker = threading.Thread(target=_post, args=(url, list(range(base, base + 3000)), None, out, "blocker"))
    blocker.start()
    while "blocker" not in out and _load(url, "num_running_reqs") == 0:  # the long one runs
        time.sleep(0.01)
    threads = []
    for i, p in enumerate(prios):
        ids = list(range(base + 10_000 * (i + 1), base + 10_000 * (i + 1) + 100))
        t = threading.Thread(target=_post, args=(url, ids, p, out, f"r{i}:{p}"))
        t.start()
        threads.append(t)
        time.sleep(0.05)
    queued = _load(url, "num_waiting_reqs")
    for t in [blocker, *threads]:
        t.join()
    assert queued == len(prios), "the long request ended before the others queued (machine too slow)"
    keys = [k for k in out if k != "blocker"]
    assert out["blocker"] < min(out[k] for k in keys)
    return sorted(keys, key=lambda k: out[k])


def test_priority_order_and_fifo_default(procs):
    prios = [None, 1, 5, 3, 5]
    on = _worker(procs, enable_priority_scheduling=True, disable_priority_preemption=True)
    info = client().get(on.url + "/server_info").json()
    assert info["enable_priority_scheduling"] is True and info["disable_priority_preemption"] is True
    assert _start_order(on.url, prios) == ["r2:5", "r4:5", "r3:3", "r1:1", "r0:None"]
    low = _worker(procs, enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert _start_order(low.url, prios) == ["r1:1", "r3:3", "r2:5", "r4:5", "r0:None"]
    off = _worker(procs)
    assert _start_order(off.url, prios) == ["r0:None", "r1:1", "r2:5", "r3:3", "r4:5"]
    r = client().post(on.url + "/generate", json={"input_ids": [1, 2, 3], "priority": "urgent"})
    assert r.status_code == 400 and "priority" in r.text
