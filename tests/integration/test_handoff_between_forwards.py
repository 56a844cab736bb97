"""``handoff.between_forwards`` on the emulator: an emulated PD prefill worker hands a finished
prefill over only between its forwards, as SGLang's PD prefill loop does. A's prefill (1,000
tokens at 1 ms a token) ends as the worker starts B's forward (B arrived during A's), so A's
KV leaves, and its first token comes, only when B's forward ends."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import pytest

from stack.core.cost_model import CostModel, HandoffCost, load_hardware
from support.emulated_pd import emulated_pd

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """1 prefill + 1 decode emulated worker, 1 ms a prompt token, handing over between
    forwards; our router in front."""
    hw = replace(
        load_hardware("h200"),
        name="between",
        cost=CostModel(1e-3, 0.0, 0.01),
        handoff=HandoffCost(between_forwards=True),
    )
    with emulated_pd(tmp_path_factory.mktemp("between"), hw) as (url, _):
        yield url


def test_a_prefill_done_as_the_next_forward_starts_waits_for_its_end(pd):
    done: dict[str, float] = {}
    t0 = time.monotonic()

    def send(name: str, first: int, n: int) -> None:
        body = {"input_ids": list(range(first, first + n)), "sampling_params": {"max_new_tokens": 1}}
        r = httpx.post(pd + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic() - t0

    a = threading.Thread(target=send, args=("a", 100, 1000))
    b = threading.Thread(target=send, args=("b", 3000, 500))
    a.start()
    time.sleep(0.3)  # B arrives during A's forward (1.01 s)
    b.start()
    a.join()
    b.join()
    # A's forward ends near 1.0 s and B's (0.51 s) starts at once: handed over at once, A
    # would be answered about 0.5 s before B; between forwards, A leaves with B's forward's end
    assert done["a"] >= 1.4
    assert done["a"] >= done["b"] - 0.15
