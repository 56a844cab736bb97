"""router.dispatch.sglang_priority: each request's SGLang ``priority``, its priority class
from the slack it has left when dispatched (less slack -> higher value; one of 8 values),
on both workers' bodies; none on /v1/messages (header instead)."""

from __future__ import annotations

import pytest

from stack.config import parse_config
from stack.core.types import SLO
from stack.decode_router.bodies import RoomAllocator, pd_body
from stack.dispatch.sglang_priority import N_CLASSES, class_priority, dispatch_priority
from stack.models.tiny import build_tiny_model
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(90)


def test_less_slack_higher_priority_few_values():
    slo = SLO()
    ps = [
        dispatch_priority(slo.ttft(L), w / 1000.0, slo)
        for L in range(0, 300_000, 2999)
        for w in range(0, 20_000, 97)
    ]
    assert all(type(p) is int for p in ps)
    assert set(ps) == set(range(N_CLASSES))  # 8 values whatever the deadlines: 8 metric labels
    for L in (100, 30_000, 120_000):  # waiting longer never lowers the priority
        by_wait = [dispatch_priority(slo.ttft(L), w / 10.0, slo) for w in range(200)]
        assert by_wait == sorted(by_wait)
    assert dispatch_priority(slo.ttft(100), 30.0, slo) == class_priority(0)  # past its deadline


def test_pd_body_sets_priority_over_the_clients():
    rooms = RoomAllocator()
    raw, body = b'{"text":"hi"}', {"text": "hi"}
    import orjson

    out, _, _ = pd_body(raw, body, None, rooms, {"priority": 7})
    assert orjson.loads(out)["priority"] == 7
    body2 = {"text": "hi", "priority": 10**9}
    out, _, _ = pd_body(orjson.dumps(body2), body2, None, rooms, {"priority": 7})
    assert out.count(b'"priority"') == 1 and orjson.loads(out)["priority"] == 7
    out, _, _ = pd_body(raw, body, None, rooms)
    assert b"priority" not in out


def test_config_flag_is_strict():
    assert parse_config({}).router.dispatch.sglang_priority is False
    assert parse_config({"router": {"dispatch": {"sglang_priority": True}}}).router.dispatch.sglang_priority
    with pytest.raises(ValueError, match="sglang_priority"):
        parse_config({"router": {"dispatch": {"sglang_priority": "yes"}}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _send(c: Cluster) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    for path, body in [
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": msgs}),
        ("/v1/completions", {"model": "tiny", "max_tokens": 4, "prompt": "hello there"}),
        ("/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}),
        ("/v1/responses", {"model": "tiny", "input": "hello there", "max_output_tokens": 4}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": msgs}),
    ]:
        r = c.client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)


def _seen(c: Cluster) -> dict[str, list[tuple[dict, dict]]]:
    out: dict[str, list] = {}
    for w in c.prefill + c.decode:
        for (path, body, _), hdrs in zip(w.records, w.headers, strict=True):
            out.setdefault(path, []).append((w.mode, body, hdrs))
    return out


@pytest.mark.parametrize("on", [True, False], ids=["enabled", "disabled"])
def test_priority_reaches_both_workers(model_dir, on):
    kw = {"agent_paths": True}
    c = Cluster(
        model_dir, n_prefill=1, n_decode=1, prefill_kw=kw, decode_kw=kw,
        router={"dispatch": {"sglang_priority": on}},
    )  # fmt: skip
    try:
        c.wait_for(lambda: all(w.healthy for w in c.state.registry.workers.values()))
        _send(c)
        seen = _seen(c)
        for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses"):
            got = seen[path]
            assert sorted(m for m, _, _ in got) == ["decode", "prefill"], path
            prios = {b.get("priority") for _, b, _ in got}
            assert len(prios) == 1, (path, prios)  # the same value on both workers
            (p,) = prios
            if not on:
                assert p is None
                continue
            # a short prompt dispatched at once: slack about SLO.b, class 0, the highest value
            assert p == class_priority(0) == N_CLASSES - 1
        msgs = seen["/v1/messages"]
        assert sorted(m for m, _, _ in msgs) == ["decode", "prefill"]
        assert all("priority" not in b for _, b, _ in msgs)
        hdr = {h.get("x-override-priority") for _, _, h in msgs}
        assert len(hdr) == 1
        if on:
            assert int(hdr.pop()) == class_priority(0)
        else:
            assert hdr == {None}
    finally:
        c.close()


def test_order_follows_deadline(model_dir):
    """A long prompt sent first has more slack than a short one sent just after (ttft grows
    with L), so its class is a later one: the worker runs the short one first."""
    kw = {"agent_paths": True}
    c = Cluster(
        model_dir, n_prefill=1, n_decode=1, prefill_kw=kw, decode_kw=kw,
        router={"dispatch": {"sglang_priority": True}, "slo": {"b": 0.5, "a_per_1k": 2.0}},
    )  # fmt: skip
    try:
        c.wait_for(lambda: all(w.healthy for w in c.state.registry.workers.values()))
        long = " ".join(f"w{i}" for i in range(1500))
        for text in (long, "short"):
            r = c.client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200
        (_, first, _), (_, second, _) = c.prefill[0].records
        assert first["priority"] < second["priority"]
    finally:
        c.close()
