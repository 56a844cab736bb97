"""Agent APIs end to end: the official `anthropic` SDK (Messages) and `openai` SDK (Responses)
against `smetric up` (router + emulated PD workers on loopback): plain and streamed answers
with usage, a tool_use -> tool_result follow-up that sticks to the worker holding its prefix,
count_tokens growing with the history, each error shape; plus the envelopes when no worker
is left (529 overloaded_error) and hypothesis fuzzing of the new endpoints (no 5xx)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)

SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 20, "cache_control": {"type": "ephemeral"}}]
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]


@pytest.fixture(scope="module")
def stack_info(tmp_path_factory):
    from stack.replay.localstack import local_stack

    with local_stack(
        prefill=2,
        decode=1,
        ports="auto",
        time_factor=0.001,
        mooncake=False,
        run_dir=tmp_path_factory.mktemp("run"),
    ) as info:
        yield info


@pytest.fixture(scope="module")
def ac(stack_info):
    c = anthropic.Anthropic(base_url=stack_info["router_url"], api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def oc(stack_info):
    c = openai.OpenAI(base_url=stack_info["router_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def raw(stack_info):
    with httpx.Client(base_url=stack_info["router_url"], timeout=30) as c:
        yield c


#: a Claude Code model name: accepted by default (router.models.accept: claude-*)
CLAUDE = "claude-sonnet-4-5"


def _served(oc) -> str:
    """The model the local stack serves (the first of /v1/models)."""
    return oc.models.list().data[0].id


def _user(text):
    return [{"role": "user", "content": text}]


def test_messages_plain(ac):
    m = ac.messages.create(model=CLAUDE, max_tokens=5, system=SYSTEM, messages=_user("fix the bug " * 30))
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.output_tokens <= 5 and m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 30


def test_messages_streamed(ac):
    events = []
    with ac.messages.stream(model=CLAUDE, max_tokens=6, messages=_user("stream please " * 20)) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    assert events[0] == "message_start" and "content_block_delta" in events
    assert final.content[0].text and final.usage.output_tokens >= 1
    assert final.stop_reason in ("max_tokens", "end_turn")


def test_count_tokens_grows_and_matches_usage(ac):
    hist = _user("list the files " * 10)
    n1 = ac.messages.count_tokens(model=CLAUDE, messages=hist, system=SYSTEM, tools=TOOLS).input_tokens
    m = ac.messages.create(model=CLAUDE, max_tokens=3, messages=hist, system=SYSTEM, tools=TOOLS)
    assert n1 == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    hist2 = hist + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and more " * 5}]
    n2 = ac.messages.count_tokens(model=CLAUDE, messages=hist2, system=SYSTEM, tools=TOOLS).input_tokens
    assert n2 > n1


def _hint_metric(raw, source: str, outcome: str) -> float:
    for line in raw.get("/metrics").text.splitlines():
        if (
            line.startswith("smetric_session_hints_total{")
            and f'source="{source}"' in line
            and f'outcome="{outcome}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_tool_result_follow_up_sticks(ac, raw):
    hdr = {"x-claude-code-session-id": "sess-sticky-1"}
    hist = [{"role": "user", "content": "fix main.py: " + "the parser fails on empty input. " * 40}]
    m1 = ac.messages.create(
        model=CLAUDE, max_tokens=4, system=SYSTEM, tools=TOOLS, messages=hist, extra_headers=hdr
    )
    n1 = m1.usage.input_tokens + (m1.usage.cache_read_input_tokens or 0)
    hist += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "def main(argv): pass"}],
        },
    ]
    m2 = ac.messages.create(
        model=CLAUDE, max_tokens=4, system=SYSTEM, tools=TOOLS, messages=hist, extra_headers=hdr
    )
    # the follow-up went to the worker holding the first turn's prefix: most of it was a hit
    assert (m2.usage.cache_read_input_tokens or 0) >= n1 // 2
    assert _hint_metric(raw, "claude_code", "agree") >= 1


def test_anthropic_error_shapes(ac, raw, stack_info):
    with pytest.raises(anthropic.BadRequestError) as ei:
        ac.messages.create(model=CLAUDE, max_tokens=5, messages=[])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    r = raw.post("/v1/messages", json={"model": CLAUDE, "messages": _user("x")})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = raw.post("/v1/messages", json={"model": CLAUDE, "max_tokens": "5", "messages": _user("x")})
    assert r.status_code == 400 and r.json()["type"] == "error"
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=CLAUDE, max_tokens=5, messages=[{"role": "user", "content": [img]}])
    r = raw.post("/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no route /v1/messages/batches"},
    }
    r = raw.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = (
        b'{"model": "claude-sonnet-4-5", "max_tokens": 1, "messages": [{"role": "user", "content": "'
        + b"x" * (33 << 20)
        + b'"}]}'
    )
    r = raw.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_responses_plain_and_streamed(oc):
    r = oc.responses.create(
        model=_served(oc), instructions="be brief", input="hello " * 20, max_output_tokens=5
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and r.usage.input_tokens > 20 and r.usage.output_tokens <= 5
    events = list(
        oc.responses.create(model=_served(oc), input="stream " * 10, max_output_tokens=4, stream=True)
    )
    types = [ev.type for ev in events]
    assert types[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in types
    assert types[-1] in ("response.completed", "response.incomplete")  # SGLang: incomplete on the budget
    final = events[-1].response
    assert final.output_text and final.usage.output_tokens <= 4
    assert [ev.sequence_number for ev in events] == list(range(len(events)))


def test_responses_function_call_follow_up(oc):
    tools = [{"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}]
    inp = [
        {"role": "user", "content": "list the files " * 20},
        {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py b.py"},
    ]
    r = oc.responses.create(model=_served(oc), input=inp, tools=tools, max_output_tokens=4, store=False)
    assert r.output_text and r.usage.input_tokens > 20


def test_responses_stateful_refused(oc):
    for kw in ({"previous_response_id": "resp_123"}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as ei:
            oc.responses.create(model=_served(oc), input="x", **kw)
        assert ei.value.status_code == 400 and "stateless" in ei.value.body["message"]


def test_no_worker_is_529_overloaded(tmp_path):
    from stack.models.tiny import build_tiny_model
    from support.router_harness import Cluster

    c = Cluster(
        build_tiny_model(tmp_path / "tiny"), n_prefill=1, n_decode=1, router={"health_interval_s": 30}
    )
    try:
        reg = c.state.registry
        for w in reg.role("prefill"):  # every prefill worker ejected: nothing can take a request
            reg.mark_failed(w, c.cfg.router.health_failures, immediate=True)
        body = {"model": "tiny", "max_tokens": 4, "messages": _user("hi " * 20)}
        r = c.client.post("/v1/messages", json=body)
        assert r.status_code == 529 and r.json() == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "no prefill worker available"},
        }
        assert r.headers["retry-after"]
        r = c.client.post("/v1/responses", json={"model": "tiny", "input": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        n = c.client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": _user("hi")})
        assert n.status_code == 200 and n.json()["input_tokens"] > 0  # no hand-off needed
    finally:
        c.close()


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=10), ch, max_size=4),
    max_leaves=20,
)
_block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "bogus"])},
    optional={
        "text": _json,
        "id": _json,
        "name": _json,
        "input": _json,
        "content": _json,
        "tool_use_id": _json,
        "thinking": _json,
    },
)
_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", 3])},
    optional={"content": st.one_of(st.text(max_size=30), st.lists(_block, max_size=3), _json)},
)
_anthropic_body = st.fixed_dictionaries(
    {},
    optional={
        "model": _json | st.just(CLAUDE),
        "max_tokens": st.integers(-2, 8) | _json,
        "messages": st.lists(_msg, max_size=4) | _json,
        "system": _json | st.lists(_block, max_size=2),
        "tools": _json | st.lists(st.fixed_dictionaries({"name": _json, "input_schema": _json}), max_size=2),
        "tool_choice": _json,
        "thinking": _json,
        "stream": _json,
        "output_config": _json,
    },
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
        "role": st.sampled_from(["user", "assistant", "developer", "system", "tool"]),
        "content": st.text(max_size=20)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": _json}
            ),
            max_size=2,
        )
        | _json,
        "call_id": _json,
        "name": _json,
        "arguments": _json,
        "output": _json,
        "summary": _json,
    },
)
_responses_body = st.fixed_dictionaries(
    {},
    optional={
        "model": _json,
        "input": st.text(max_size=20) | st.lists(_item, max_size=4) | _json,
        "instructions": _json,
        "tools": _json
        | st.lists(
            st.fixed_dictionaries({"type": st.just("function"), "name": _json, "parameters": _json}),
            max_size=2,
        ),
        "tool_choice": _json,
        "store": _json,
        "previous_response_id": _json,
        "reasoning": _json,
        "max_output_tokens": _json,
        "stream": _json,
    },
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=_anthropic_body, path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_fuzz_anthropic_no_5xx(raw, body, path):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
        body["max_tokens"] = min(body["max_tokens"], 3)
    r = raw.post(path, json=body)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.json()["type"] == "error" and isinstance(r.json()["error"]["message"], str)


@FUZZ
@given(body=_responses_body)
def test_fuzz_responses_no_5xx(raw, body):
    body["max_output_tokens"] = 3
    r = raw.post("/v1/responses", json=body)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
