"""Tool calls through the router, as agents receive them: the official SDKs against `smetric up`
(the default config, configs/local.yaml: emulated PD workers started with the config's
``model.tool_call_parser``, the router in front). A request whose ``tool_choice`` forces a call
gets it back in its API's shape, whole and streamed: OpenAI chat ``tool_calls``, Anthropic
``tool_use`` blocks, a Responses ``function_call`` item; ``tool_choice: auto`` answers text (the
emulator has no model to choose a call). The same checks run against real SGLang workers in the
CPU tier (tests/e2e/test_sglang_cpu.py, ``TestPDStack.test_tool_calls_*``)."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}, "mode": {"enum": ["r", "rb"]}},
    "required": ["path", "mode"],
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file", "parameters": SCHEMA},
    },
]
MSG_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
PROMPT = "Read main.py and tell me what it does. " * 8


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
def model(stack_info):
    """The served model's name, as the router lists it (the router refuses names it does not serve)."""
    return httpx.get(stack_info["router_url"] + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oc(stack_info):
    c = openai.OpenAI(base_url=stack_info["router_url"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ac(stack_info):
    c = anthropic.Anthropic(base_url=stack_info["router_url"], api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def _valid(args: dict) -> None:
    """The arguments satisfy SCHEMA: the required keys, of their types."""
    assert isinstance(args["path"], str) and args["mode"] in ("r", "rb")


def test_chat_named_tool_call(oc, model):
    r = oc.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        max_tokens=200,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == "read_file" and call.id.startswith("call_")
    _valid(json.loads(call.function.arguments))
    assert r.usage.completion_tokens >= 1


def test_chat_required_tool_call_streamed(oc, model):
    stream = oc.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT + " stream"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=200,
        stream=True,
    )
    ids, names, args, finish = set(), [], "", None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                args += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert names == ["ls"] and len(ids) == 1  # required: the first tool; its id and name come once
    assert json.loads(args) == {} and finish == "tool_calls"


def test_chat_auto_answers_text(oc, model):
    r = oc.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], tools=CHAT_TOOLS, max_tokens=5
    )
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")


def test_chat_call_cut_by_max_tokens_is_length(oc, model):
    r = oc.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        max_tokens=2,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_messages_tool_use(ac):
    m = ac.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=200,
        tools=MSG_TOOLS,
        tool_choice={"type": "tool", "name": "read_file"},
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "read_file" and block.id
    _valid(block.input)


def test_messages_tool_use_streamed(ac):
    with ac.messages.stream(
        model="claude-sonnet-4-5",
        max_tokens=200,
        tools=MSG_TOOLS,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": PROMPT + " stream"}],
    ) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use" and block.name == "ls" and block.input == {}


def test_responses_function_call(oc, model):
    tools = [{"type": "function", "name": "read_file", "parameters": SCHEMA}]
    r = oc.responses.create(
        model=model, input=PROMPT, tools=tools, tool_choice="required", max_output_tokens=200, store=False
    )
    [item] = r.output
    assert item.type == "function_call" and item.name == "read_file" and item.call_id.startswith("call_")
    _valid(json.loads(item.arguments))
    events = list(
        oc.responses.create(
            model=model,
            input=PROMPT + " s",
            tools=tools,
            tool_choice="required",
            max_output_tokens=200,
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    _valid(json.loads(done.arguments))
