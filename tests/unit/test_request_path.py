"""One request path: the null trace stands in for every stage of a real one, and a request
that is not routed is answered from one table."""

from __future__ import annotations

import inspect

import orjson
import pytest

from stack.prefill_router.api.errors import ANTHROPIC, OPENAI, RESPONSES
from stack.prefill_router.api.inference import NOT_ROUTED
from stack.prefill_router.errors import Cancelled, Overloaded
from stack.prefill_router.routing import NoWorker
from stack.prefill_router.tracing import (
    NO_TRACING,
    NULL_TRACE,
    NullTrace,
    RequestTrace,
    RouterTracing,
    current,
)


def _stages(cls) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(f)
        for n, f in inspect.getmembers(cls, inspect.isfunction)
        if not n.startswith("_") and n != "traceparent"
    }


def test_the_null_trace_has_every_stage_of_a_real_one():
    real, null = _stages(RequestTrace), _stages(NullTrace)
    assert set(real) == set(null)
    for name, sig in real.items():
        assert list(sig.parameters) == list(null[name].parameters), name


def test_tracing_off_makes_nothing():
    assert not NO_TRACING.enabled and RouterTracing.enabled
    assert NO_TRACING.start("POST", "/v1/chat/completions", "chat", {}) is NULL_TRACE
    assert current() is NULL_TRACE  # outside a traced request
    assert NULL_TRACE.hand_off(object()) is None  # no traceparent headers
    with pytest.raises(RuntimeError):
        NO_TRACING.add_span_processor(object())


@pytest.mark.parametrize(
    "exc, kind, status, reason",
    [
        (Cancelled(), "cancelled", 499, "cancelled"),
        (NoWorker("decode"), "no_worker", 503, "no decode worker"),
        (Overloaded("queue_full", 0.0, 2), "overloaded", 503, "queue_full"),
        (Overloaded("feature_wait", 10.5, 2), "overloaded", 503, "feature_wait"),
    ],
)
def test_not_routed_table(exc, kind, status, reason):
    got_kind, resp, got_reason = NOT_ROUTED[type(exc)](exc, OPENAI, 2)
    assert (got_kind, resp.status_code, got_reason) == (kind, status, reason)
    if status != 499:
        assert resp.headers["retry-after"] == "2"
        assert orjson.loads(resp.body)["error"]["message"]
    # the same failure in Anthropic's and Responses' envelopes
    for env in (ANTHROPIC, RESPONSES):
        k, r, _ = NOT_ROUTED[type(exc)](exc, env, 2)
        assert k == kind and (r.status_code == 499) == (status == 499)
    if isinstance(exc, Overloaded):
        assert NOT_ROUTED[Overloaded](exc, ANTHROPIC, 2)[1].status_code == 529
