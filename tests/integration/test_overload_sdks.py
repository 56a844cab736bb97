"""Overload through the official SDKs: a client refused by the router's bounded queue gets the
overload answer in its API's shape (OpenAI 503, Anthropic 529, with Retry-After), the SDK
retries it as it does by default, and every call then succeeds or fails cleanly after its
retries; nothing hangs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from stack.models.tiny import build_tiny_model
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)

CALLS = 8
RETRIES = 2  # both SDKs' default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # one prefill worker taking 0.3 s a prefill, one request in work and one queued: the rest
    # of a burst is refused at admission (queue_full) and comes back after Retry-After (1 s)
    c = Cluster(
        build_tiny_model(tmp_path_factory.mktemp("tiny")),
        n_prefill=1,
        n_decode=1,
        prefill_kw={"prefill_delay_s": 0.3, "agent_paths": True},
        decode_kw={"agent_paths": True},  # the fake answers /v1/messages too
        router={
            "retry_after_s": 1,
            "dispatch": {"order": "fifo", "max_queue": 1, "readiness": {"max_running": 1}},
        },
    )
    yield c
    c.close()


class Attempts:
    """Counts the HTTP attempts an SDK makes (its retries included) and their statuses."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.retry_after: set[str] = set()

    def hook(self, r) -> None:
        with self.lock:
            self.statuses.append(r.status_code)
            if r.status_code >= 500:
                self.retry_after.add(r.headers.get("retry-after", ""))

    def client(self, sdk):
        """The SDK's own HTTP client class (the Anthropic SDK's is httpx2's), with the hook."""
        return sdk.DefaultHttpxClient(event_hooks={"response": [self.hook]})


def _burst(call) -> tuple[list, float]:
    t0 = time.monotonic()
    with ThreadPoolExecutor(CALLS) as ex:
        futs = [ex.submit(call, i) for i in range(CALLS)]
        outcomes = []
        for f in futs:
            try:
                outcomes.append(f.result(timeout=60))
            except Exception as e:  # noqa: BLE001 - the outcome is checked below
                outcomes.append(e)
    return outcomes, time.monotonic() - t0


def _check(attempts: Attempts, outcomes: list, status: int, error_type: type) -> None:
    refused = [s for s in attempts.statuses if s == status]
    assert refused, attempts.statuses  # the burst was past the bound: some were refused
    assert set(attempts.statuses) <= {200, status}, attempts.statuses
    assert attempts.retry_after and all(v.isdigit() and int(v) >= 1 for v in attempts.retry_after)
    # the SDK retried the refused ones: more attempts than calls
    assert len(attempts.statuses) > CALLS
    ok = [o for o in outcomes if not isinstance(o, Exception)]
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert all(isinstance(e, error_type) and e.status_code == status for e in failed), failed
    # a call that failed did so after its retries (1 + RETRIES refusals each), not at once
    assert len(refused) >= len(failed) * (1 + RETRIES)
    assert ok  # some got through, after waiting their turn or retrying


def test_openai_sdk_retries_the_overload_answer_and_ends_cleanly(cluster):
    attempts = Attempts()
    client = openai.OpenAI(
        base_url=cluster.url + "/v1",
        api_key="unused",
        max_retries=RETRIES,
        timeout=30,
        http_client=attempts.client(openai),
    )

    def call(i: int):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2
        )

    outcomes, took = _burst(call)
    _check(attempts, outcomes, 503, openai.APIStatusError)
    assert took < 60


def test_anthropic_sdk_retries_the_overload_answer_and_ends_cleanly(cluster):
    attempts = Attempts()
    client = anthropic.Anthropic(
        base_url=cluster.url,
        api_key="unused",
        max_retries=RETRIES,
        timeout=30,
        http_client=attempts.client(anthropic),
    )

    def call(i: int):
        return client.messages.create(
            model="tiny", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2
        )

    outcomes, took = _burst(call)
    _check(attempts, outcomes, 529, anthropic.APIStatusError)
    assert took < 60
