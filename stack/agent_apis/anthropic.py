"""Anthropic Messages: validation and conversion to chat, as SGLang 0.5.23 does it.

SGLang's ``AnthropicServing._convert_to_chat_completion_request``: the ``system`` texts (a
string, or the non-empty ``text`` blocks) become one leading system message joined by
newlines; a string content passes through; blocks become text parts (one text part
collapses to a string), ``tool_use`` blocks become the assistant's ``tool_calls``
(``arguments`` = ``json.dumps(input)``), a user's ``tool_result`` blocks become ``tool``
messages (text before them is flushed first as a user message; a list content becomes its
text, one text part per tool message), ``thinking`` blocks are dropped (no reasoning parser:
SGLang drops prior thinking when it cannot rewrap it); ``tools`` become function tools
(``input_schema`` gains ``"type": "object"`` when it has none; the ``web_search_*``,
``bash_*``, ... server tools are skipped); ``tool_choice`` maps auto/any/tool/none to
auto/required/named/none. ``cache_control`` is ignored everywhere. Images are refused (the
emulator and the models this stack serves are text-only); so are ``redacted_thinking``
history (SGLang refuses it too) and ``thinking`` enabled (SGLang refuses it without a
reasoning parser).
"""

from __future__ import annotations

import json
import re
from typing import Any

from stack.agent_apis.chat_step import ChatRequest, tool_dump
from stack.agent_apis.errors import AgentError

_SERVER_TOOL = re.compile(r"^(web_search|computer|bash|text_editor)_\d{8}$")
_BLOCKS = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "search_result",
    "thinking",
    "redacted_thinking",
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(v, param: str, required: bool = True, empty_ok: bool = True) -> None:
    if v is None and not required:
        return
    if not isinstance(v, str) or (not empty_ok and not v):
        raise AgentError(f"{param}: {'required ' if v is None else ''}string expected", param)


def _block(b, param: str, *, nested: bool = False) -> None:
    if not isinstance(b, dict):
        raise AgentError(f"{param}: a content block must be an object", param)
    t = b.get("type")
    if t not in _BLOCKS:
        raise AgentError(f"{param}.type: unknown content block type {t!r}", f"{param}.type")
    if t == "image":
        raise AgentError(f"{param}: image content is not supported by this text-only model", param)
    if t == "text":
        _str(b.get("text"), f"{param}.text")
    elif t == "tool_use":
        _str(b.get("id"), f"{param}.id")
        _str(b.get("name"), f"{param}.name")
        if b.get("input") is not None and not isinstance(b["input"], dict):
            raise AgentError(f"{param}.input: an object expected", f"{param}.input")
    elif t == "tool_result":
        for k in ("tool_use_id", "id"):
            _str(b.get(k), f"{param}.{k}", required=False)
        c = b.get("content")
        if c is not None and not isinstance(c, str):
            if not isinstance(c, list):
                raise AgentError(
                    f"{param}.content: a string or a list of blocks expected", f"{param}.content"
                )
            for j, x in enumerate(c):
                _block(x, f"{param}.content[{j}]", nested=True)
        if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
            raise AgentError(f"{param}.is_error: a boolean expected", f"{param}.is_error")
    elif t == "thinking":
        _str(b.get("thinking"), f"{param}.thinking")
    elif t == "redacted_thinking":
        raise AgentError("Anthropic redacted_thinking history is not supported", param)
    elif t == "tool_reference":
        for k in ("name", "tool_name", "id"):
            _str(b.get(k), f"{param}.{k}", required=False)
    elif t == "search_result":
        if b.get("content") is not None and not isinstance(b["content"], list):
            raise AgentError(f"{param}.content: a list expected", f"{param}.content")
        _str(b.get("title"), f"{param}.title", required=False)


def _content(c, param: str) -> None:
    if isinstance(c, str):
        return
    if not isinstance(c, list):
        raise AgentError(f"{param}: a string or a list of content blocks expected", param)
    for j, b in enumerate(c):
        _block(b, f"{param}[{j}]")


def validate(body: dict[str, Any], count_only: bool = False) -> None:
    """Raise :class:`AgentError` (400 ``invalid_request_error``) unless ``body`` is a valid
    Messages (or, ``count_only``, count_tokens) request SGLang would accept."""
    model = body.get("model")
    if not isinstance(model, str) or (not model and not count_only):
        raise AgentError("model: a non-empty string is required", "model")
    if not count_only:
        mt = body.get("max_tokens")
        if mt is None:
            raise AgentError("max_tokens: Field required", "max_tokens")
        if not _is_int(mt) or mt <= 0:
            raise AgentError("max_tokens: a positive integer is required", "max_tokens")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise AgentError("stream: a boolean expected", "stream")
        for k in ("temperature", "top_p"):
            v = body.get(k)
            if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
                raise AgentError(f"{k}: a number expected", k)
        if body.get("top_k") is not None and not _is_int(body["top_k"]):
            raise AgentError("top_k: an integer expected", "top_k")
        ss = body.get("stop_sequences")
        if ss is not None and (not isinstance(ss, list) or not all(isinstance(s, str) for s in ss)):
            raise AgentError("stop_sequences: a list of strings expected", "stop_sequences")
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise AgentError("metadata: an object expected", "metadata")
    msgs = body.get("messages")
    if msgs is None:
        raise AgentError("messages: Field required", "messages")
    if not isinstance(msgs, list):
        raise AgentError("messages: a list expected", "messages")
    if not msgs:
        raise AgentError("messages: at least one message is required", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise AgentError(f"messages[{i}]: an object expected", f"messages[{i}]")
        if m.get("role") not in ("user", "assistant", "system"):
            raise AgentError(f"messages[{i}].role: 'user' or 'assistant' expected", f"messages[{i}].role")
        if "content" not in m:
            raise AgentError(f"messages[{i}].content: Field required", f"messages[{i}].content")
        _content(m["content"], f"messages[{i}].content")
    system = body.get("system")
    if system is not None:
        _content(system, "system")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise AgentError("tools: a list expected", "tools")
        for i, t in enumerate(tools):
            p = f"tools[{i}]"
            if not isinstance(t, dict):
                raise AgentError(f"{p}: an object expected", p)
            tt = t.get("type")
            if tt is not None and not isinstance(tt, str):
                raise AgentError(f"{p}.type: a string expected", f"{p}.type")
            if tt and tt != "custom" and _SERVER_TOOL.match(tt):
                continue
            _str(t.get("name"), f"{p}.name")
            if not isinstance(t.get("input_schema"), dict):
                raise AgentError(f"{p}.input_schema: an object is required", f"{p}.input_schema")
            _str(t.get("description"), f"{p}.description", required=False)
            if t.get("strict") is not None and not isinstance(t["strict"], bool):
                raise AgentError(f"{p}.strict: a boolean expected", f"{p}.strict")
    tc = body.get("tool_choice")
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none"):
            raise AgentError("tool_choice.type: one of auto, any, tool, none", "tool_choice")
        _str(tc.get("name"), "tool_choice.name", required=tc["type"] == "tool")
        if tc["type"] == "tool" and not any(
            isinstance(t, dict) and t.get("name") == tc["name"] for t in tools or []
        ):
            raise AgentError(
                f"tool_choice.name: tool {tc['name'][:64]!r} is not among the tools", "tool_choice.name"
            )
    th = body.get("thinking")
    if th is not None:
        if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive"):
            raise AgentError("thinking.type: one of enabled, disabled, adaptive", "thinking")
        if th["type"] != "disabled":
            raise AgentError(
                "Anthropic thinking is not supported for models without a reasoning parser", "thinking"
            )
        if th.get("budget_tokens") is not None or th.get("display") is not None:
            raise AgentError(
                "thinking: no other field is allowed when thinking.type is 'disabled'", "thinking"
            )
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise AgentError("output_config: an object expected", "output_config")
        eff = oc.get("effort")
        if eff is not None and eff not in ("minimal", "low", "medium", "high", "xhigh", "max"):
            raise AgentError("output_config.effort: unknown effort", "output_config.effort")


def _system_text(c) -> str | None:
    if isinstance(c, str):
        return c.strip() or None
    texts = [(b.get("text") or "").strip() for b in c if b.get("type") == "text"]
    texts = [t for t in texts if t]
    return "\n".join(texts) if texts else None


def _search_text(item: dict) -> str:
    parts = []
    if item.get("title"):
        parts.append(f"Title: {item['title']}")
    src = item.get("source")
    if isinstance(src, dict):
        s = src.get("url") or src.get("text")
        if s:
            parts.append(f"Source: {s}")
    elif src:
        parts.append(f"Source: {src}")
    content = item.get("content")
    cps = []
    if isinstance(content, str):
        cps.append(content)
    elif isinstance(content, list):
        cps += [
            p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text" and p.get("text")
        ]
    if cps:
        parts.append("Content: " + "\n".join(cps))
    return "\n".join(parts)


def _tool_result_content(content) -> tuple[list, str]:
    if isinstance(content, list):
        parts: list[dict] = []
        texts: list[str] = []
        for item in content:
            t = item.get("type")
            if t == "text":
                if item.get("text"):
                    texts.append(item["text"])
                    parts.append({"type": "text", "text": item["text"]})
            elif t == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    parts.append({"type": "tool_reference", "name": name})
            elif t == "search_result":
                s = _search_text(item)
                if s:
                    texts.append(s)
                    parts.append({"type": "text", "text": s})
        groups: list[list[dict]] = []
        for p in parts:
            ref = p["type"] == "tool_reference"
            if not groups or (groups[-1][0]["type"] == "tool_reference") != ref:
                groups.append([])
            groups[-1].append(p)
        out: list = [g[0]["text"] if len(g) == 1 and g[0]["type"] == "text" else g for g in groups]
        return out or [""], "\n".join(texts)
    text = str(content) if content else ""
    return [text], text


def to_chat(body: dict[str, Any], inline_system: bool) -> ChatRequest:
    """The Chat Completions request SGLang makes of a valid Messages ``body``
    (``inline_system``: the template renders mid-conversation system messages)."""
    msgs: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = body.get("system")
    if system:
        if isinstance(system, str):
            if system.strip():
                system_parts.append(system)
        else:
            system_parts += [b["text"] for b in system if b.get("type") == "text" and b.get("text")]
    merge = not inline_system
    if merge:
        for m in body["messages"]:
            if m["role"] == "system" and (t := _system_text(m["content"])):
                system_parts.append(t)
    if system_parts:
        msgs.append({"role": "system", "content": "\n".join(system_parts)})

    def flush(parts: list[dict]) -> None:
        if not parts:
            return
        if len(parts) == 1 and parts[0]["type"] == "text":
            msgs.append({"role": "user", "content": parts[0]["text"]})
        else:
            msgs.append({"role": "user", "content": list(parts)})
        parts.clear()

    for m in body["messages"]:
        role = m["role"]
        if role == "system" and merge:
            continue
        if isinstance(m["content"], str):
            msgs.append({"role": role, "content": m["content"]})
            continue
        om: dict[str, Any] = {"role": role}
        parts: list[dict] = []
        calls: list[dict] = []
        for b in m["content"]:
            t = b["type"]
            if t in ("thinking", "redacted_thinking"):
                continue
            if t == "text":
                parts.append({"type": "text", "text": b["text"]})
            elif t == "search_result":
                if s := _search_text(b):
                    parts.append({"type": "text", "text": s})
            elif t == "tool_use":
                calls.append(
                    {
                        "id": b["id"],
                        "type": "function",
                        "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
                    }
                )
            elif t == "tool_result":
                contents, text = _tool_result_content(b.get("content"))
                call_id = b.get("tool_use_id") or b.get("id") or ""
                if role == "user":
                    flush(parts)
                    for c in contents:
                        msgs.append({"role": "tool", "tool_call_id": call_id, "content": c})
                else:
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        if calls:
            om["tool_calls"] = calls
        if parts:
            om["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
            msgs.append(om)
        elif calls:
            msgs.append(om)
        elif role == "user":
            continue
        else:
            om["content"] = ""
            msgs.append(om)

    tools = []
    for t in body.get("tools") or []:
        tt = t.get("type")
        if tt and tt != "custom" and _SERVER_TOOL.match(tt):
            continue
        schema = t["input_schema"]
        if "type" not in schema:
            schema = {**schema, "type": "object"}
        tools.append(tool_dump(t["name"], t.get("description") or "", schema, bool(t.get("strict", False))))
    choice: Any = "auto"
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc["type"]
        if kind == "none":
            choice = "none"
        elif tools:
            if kind == "any":
                choice = "required"
            elif kind == "tool":
                if not any(x["function"]["name"] == tc.get("name") for x in tools):
                    raise AgentError(
                        f"tool_choice references tool {tc.get('name')!r} but it is not in the forwarded tools list",
                        "tool_choice",
                    )
                choice = {"name": tc["name"]}
        elif kind in ("any", "tool"):
            raise AgentError(f"tool_choice={kind!r} requires at least one custom tool", "tool_choice")
    effort = None
    oc = body.get("output_config") or {}
    if oc.get("effort") is not None:
        effort = "max" if oc["effort"] == "xhigh" else oc["effort"]
    return ChatRequest(
        messages=msgs,
        tools=tools,
        tool_choice=choice,
        reasoning_effort=effort,
        max_tokens=body.get("max_tokens"),
        stop=body.get("stop_sequences"),
        stream=bool(body.get("stream")),
    )
