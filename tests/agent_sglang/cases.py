"""Request bodies whose prompt ids the router must compute as SGLang does (name, api, body)."""

from __future__ import annotations

_TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        "cache_control": {"type": "ephemeral"},
    },
    {"name": "ls", "input_schema": {"properties": {"dir": {"type": "string"}}}},
    {"type": "web_search_20250305", "name": "web_search"},
]
_HIST = [
    {"role": "user", "content": "fix the bug in main.py"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should read it", "signature": "sig"},
            {"type": "text", "text": "Let me read it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "def main(argv):\n    return run(parse(argv))\n",
            }
        ],
    },
]


def _a(**kw):
    return {"model": "tiny", "max_tokens": 16, **kw}


def _r(**kw):
    return {"model": "tiny", **kw}


CASES = [
    ("a-plain", "anthropic", _a(messages=[{"role": "user", "content": "hello world"}])),
    (
        "a-system-str",
        "anthropic",
        _a(system="You are a helpful coding agent.", messages=[{"role": "user", "content": "hi"}]),
    ),
    (
        "a-system-blocks",
        "anthropic",
        _a(
            system=[
                {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "  Be brief.  "},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
                }
            ],
        ),
    ),
    (
        "a-multi-text",
        "anthropic",
        _a(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                }
            ]
        ),
    ),
    ("a-tools-history", "anthropic", _a(system="agent", tools=_TOOLS, messages=_HIST)),
    (
        "a-tool-result-blocks",
        "anthropic",
        _a(
            tools=_TOOLS,
            messages=_HIST[:2]
            + [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "here:"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [
                                {"type": "text", "text": "line 1"},
                                {"type": "text", "text": "line 2"},
                            ],
                        },
                        {"type": "text", "text": "and go on"},
                    ],
                }
            ],
        ),
    ),
    (
        "a-tool-result-empty",
        "anthropic",
        _a(
            tools=_TOOLS,
            messages=_HIST[:2]
            + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}],
        ),
    ),
    ("a-tool-choice-none", "anthropic", _a(tools=_TOOLS, tool_choice={"type": "none"}, messages=_HIST)),
    ("a-tool-choice-any", "anthropic", _a(tools=_TOOLS, tool_choice={"type": "any"}, messages=_HIST)),
    (
        "a-tool-choice-tool",
        "anthropic",
        _a(tools=_TOOLS, tool_choice={"type": "tool", "name": "ls"}, messages=_HIST),
    ),
    (
        "a-prefill-last-assistant",
        "anthropic",
        _a(messages=[{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "Hi"}]),
    ),
    (
        "a-empty-assistant",
        "anthropic",
        _a(
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]},
                {"role": "user", "content": "b"},
            ]
        ),
    ),
    (
        "a-inline-system",
        "anthropic",
        _a(
            system="top",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": "mid"},
                {"role": "user", "content": "b"},
            ],
        ),
    ),
    (
        "a-effort",
        "anthropic",
        _a(output_config={"effort": "xhigh"}, messages=[{"role": "user", "content": "x"}]),
    ),
    (
        "a-thinking-disabled",
        "anthropic",
        _a(thinking={"type": "disabled"}, messages=[{"role": "user", "content": "x"}]),
    ),
    # refused by SGLang too
    (
        "a-err-thinking-enabled",
        "anthropic",
        _a(thinking={"type": "enabled", "budget_tokens": 2048}, messages=[{"role": "user", "content": "x"}]),
    ),
    (
        "a-err-redacted",
        "anthropic",
        _a(
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": "b"},
            ]
        ),
    ),
    (
        "a-err-tool-choice-unknown",
        "anthropic",
        _a(tools=_TOOLS, tool_choice={"type": "tool", "name": "nope"}, messages=_HIST),
    ),
    ("a-err-no-max-tokens", "anthropic", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ("a-err-bad-role", "anthropic", _a(messages=[{"role": "tool", "content": "x"}])),
    # Responses
    ("r-string", "responses", _r(input="hello world")),
    ("r-instructions", "responses", _r(instructions="You are a coding agent.", input="hi")),
    (
        "r-messages",
        "responses",
        _r(
            input=[
                {"role": "developer", "content": "be brief"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "one"}, {"type": "input_text", "text": "two"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                },
                {"role": "user", "content": "three"},
            ]
        ),
    ),
    (
        "r-function-calls",
        "responses",
        _r(
            instructions="agent",
            tools=[
                {
                    "type": "function",
                    "name": "read_file",
                    "description": "Read a file",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                },
                {
                    "type": "function",
                    "name": "ls",
                    "parameters": {"type": "object", "properties": {}},
                    "strict": True,
                },
                {"type": "web_search"},
            ],
            input=[
                {"role": "user", "content": "fix main.py"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "read it first"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Reading."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "read_file",
                    "arguments": '{"path": "main.py"}',
                },
                {"type": "function_call", "call_id": "call_2", "name": "ls", "arguments": "not json"},
                {"type": "function_call_output", "call_id": "call_1", "output": "def main(argv): pass"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "a.py"}],
                },
            ],
        ),
    ),
    (
        "r-tool-choice-named",
        "responses",
        _r(
            tools=[
                {"type": "function", "name": "read_file", "parameters": {"type": "object"}},
                {"type": "function", "name": "ls", "parameters": {"type": "object"}},
            ],
            tool_choice={"type": "function", "name": "ls"},
            input="list files",
        ),
    ),
    (
        "r-tool-choice-none",
        "responses",
        _r(
            tools=[{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
            tool_choice="none",
            input="x",
        ),
    ),
    ("r-store-false", "responses", _r(store=False, input="x")),
    (
        "r-last-assistant",
        "responses",
        _r(input=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
    ),
    ("r-err-item-type", "responses", _r(input=[{"type": "computer_call", "call_id": "c"}])),
]
