"""OpenAI Responses (stateless): validation and conversion to chat, as SGLang 0.5.23 does it.

SGLang's ``OpenAIServingResponses._construct_input_messages``: ``instructions`` is a leading
system message; ``input`` is a user message (a string) or a list of items: messages (roles
user / assistant / system / developer; a developer message becomes a system one labelled
"Developer instructions:"; ``input_text`` / ``output_text`` parts become text parts),
``function_call`` items (an assistant ``tool_calls`` message, ``arguments`` coerced to a
JSON object string), ``function_call_output`` items (a ``tool`` message; a list output is
its texts joined) and ``reasoning`` items (an assistant ``reasoning_content``, empty ones
dropped); consecutive assistant messages are merged into one turn; when the template cannot
render inline system messages, every system text is merged into one leading system message.
``function`` tools become chat tools (built-in tools are skipped).

Stateless: ``previous_response_id``, ``background`` and an explicit ``"store": true`` need
server-side state and are refused with 400 (an absent ``store`` is stateless here).
"""

from __future__ import annotations

from typing import Any

import orjson

from stack.agent_apis.chat_step import ChatRequest, tool_dump
from stack.agent_apis.errors import AgentError

DEVELOPER_LABEL = "Developer instructions:"
_ITEM_TYPES = (None, "message", "function_call", "function_call_output", "reasoning")
_ROLES = ("user", "assistant", "system", "developer")
_PARTS = ("input_text", "output_text", "text")
_BUILTIN_TOOLS = (
    "web_search",
    "web_search_preview",
    "code_interpreter",
    "file_search",
    "image_generation",
    "computer_use_preview",
    "local_shell",
    "mcp",
    "tool_search",
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(body: dict[str, Any]) -> None:
    """Raise :class:`AgentError` unless ``body`` is a valid stateless Responses request."""
    if body.get("previous_response_id") is not None:
        raise AgentError(
            "previous_response_id needs server-side response storage, which this router does not keep "
            "(stateless): send the whole conversation in `input`",
            "previous_response_id",
        )
    if body.get("store") is True:
        raise AgentError(
            "store=true needs server-side response storage, which this router does not keep (stateless): "
            "send store=false or leave it out",
            "store",
        )
    if body.get("background"):
        raise AgentError(
            "background=true requires store=true, which this router does not support", "background"
        )
    for k, typ in (("stream", bool), ("store", bool), ("instructions", str), ("model", str)):
        v = body.get(k)
        if v is not None and not isinstance(v, typ):
            raise AgentError(f"'{k}' must be a {typ.__name__}", k)
    mt = body.get("max_output_tokens")
    if mt is not None and (not _is_int(mt) or mt < 1):
        raise AgentError("'max_output_tokens' must be a positive integer", "max_output_tokens")
    for k in ("temperature", "top_p"):
        v = body.get(k)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)):
            raise AgentError(f"'{k}' must be a number", k)
    if "input" not in body:
        raise AgentError("'input' is required", "input")
    inp = body["input"]
    if isinstance(inp, str):
        pass
    elif isinstance(inp, list):
        if not inp:
            raise AgentError("'input' must not be empty", "input")
        for i, it in enumerate(inp):
            _item(it, f"input[{i}]")
    else:
        raise AgentError("'input' must be a string or a list of items", "input")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise AgentError("'tools' must be a list", "tools")
        for i, t in enumerate(tools):
            p = f"tools[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("type"), str):
                raise AgentError(f"{p}: an object with a 'type' expected", p)
            if t["type"] in _BUILTIN_TOOLS:
                continue
            if t["type"] != "function":
                raise AgentError(f"{p}.type: {t['type']!r} tools are not supported", f"{p}.type")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise AgentError("Function tools must include a name.", f"{p}.name")
            if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
                raise AgentError(f"{p}.parameters: an object expected", f"{p}.parameters")
            if t.get("description") is not None and not isinstance(t["description"], str):
                raise AgentError(f"{p}.description: a string expected", f"{p}.description")
            if t.get("strict") is not None and not isinstance(t["strict"], bool):
                raise AgentError(f"{p}.strict: a boolean expected", f"{p}.strict")
    tc = body.get("tool_choice")
    if tc is not None and tc not in ("auto", "required", "none"):
        if not isinstance(tc, dict):
            raise AgentError("'tool_choice' must be auto, required, none or an object", "tool_choice")
        name = (
            tc.get("name") or (tc.get("function") or {}).get("name")
            if isinstance(tc.get("function") or {}, dict)
            else None
        )
        if not isinstance(name, str) or not any(
            isinstance(t, dict) and t.get("type") == "function" and t.get("name") == name for t in tools or []
        ):
            raise AgentError(f"Tool {name!r} is not declared in tools", "tool_choice")
    if tc == "required" and not any(isinstance(t, dict) and t.get("type") == "function" for t in tools or []):
        raise AgentError(
            'tool_choice="required" requires at least one tool with type="function"', "tool_choice"
        )
    r = body.get("reasoning")
    if r is not None and (
        not isinstance(r, dict) or (r.get("effort") is not None and not isinstance(r["effort"], str))
    ):
        raise AgentError("'reasoning' must be an object with a string 'effort'", "reasoning")
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise AgentError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise AgentError("'stop' must be a string or a list of strings", "stop")


def _item(it, p: str) -> None:
    if not isinstance(it, dict):
        raise AgentError(f"{p}: an object expected", p)
    t = it.get("type")
    if t not in _ITEM_TYPES:
        raise AgentError(f"Unsupported Responses API input item type: {t!r}", f"{p}.type")
    if t in (None, "message"):
        if it.get("role") not in _ROLES:
            raise AgentError(f"{p}.role: one of user, assistant, system, developer", f"{p}.role")
        c = it.get("content")
        if isinstance(c, str):
            return
        if not isinstance(c, list):
            raise AgentError(f"{p}.content: a string or a list of parts expected", f"{p}.content")
        for j, part in enumerate(c):
            q = f"{p}.content[{j}]"
            if not isinstance(part, dict):
                raise AgentError(f"{q}: an object expected", q)
            if part.get("type") in ("input_image", "image_url", "input_file", "input_audio"):
                raise AgentError(
                    f"{q}: image, file and audio input is not supported by this text-only model", q
                )
            if part.get("type") not in _PARTS or not isinstance(part.get("text"), str):
                raise AgentError(f"{q}: a text part (input_text / output_text) expected", q)
    elif t == "function_call":
        for k in ("call_id", "name"):
            if not isinstance(it.get(k), str):
                raise AgentError(f"{p}.{k}: a string is required", f"{p}.{k}")
        if it.get("arguments") is not None and not isinstance(it["arguments"], str | dict):
            raise AgentError(f"{p}.arguments: a string expected", f"{p}.arguments")
    elif t == "function_call_output":
        if not isinstance(it.get("call_id"), str):
            raise AgentError(f"{p}.call_id: a string is required", f"{p}.call_id")
        out = it.get("output")
        if out is not None and not isinstance(out, str):
            if not isinstance(out, list) or not all(
                isinstance(x, dict) and isinstance(x.get("text", ""), str) for x in out
            ):
                raise AgentError(f"{p}.output: a string or a list of text parts expected", f"{p}.output")
            if any(x.get("type") in ("input_image", "input_file") for x in out):
                raise AgentError(f"{p}.output: image and file output is not supported", f"{p}.output")
    elif t == "reasoning":
        for k in ("summary", "content"):
            v = it.get(k)
            if v is not None and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
                raise AgentError(f"{p}.{k}: a list of parts expected", f"{p}.{k}")
            for x in v or []:
                if x.get("text") is not None and not isinstance(x["text"], str):
                    raise AgentError(f"{p}.{k}: text must be a string", f"{p}.{k}")


def _label_developer(content):
    if isinstance(content, str):
        return f"{DEVELOPER_LABEL}\n{content}"
    for i, part in enumerate(content):
        if isinstance(part.get("text"), str):
            return [*content[:i], {**part, "text": f"{DEVELOPER_LABEL}\n{part['text']}"}, *content[i + 1 :]]
    return [{"type": "input_text", "text": DEVELOPER_LABEL}, *content]


def _normalize(it: dict[str, Any]) -> dict[str, Any] | None:
    if it.get("role") == "developer":
        it = {**it, "role": "system", "content": _label_developer(it.get("content"))}
    t = it.get("type")
    if t == "function_call":
        raw = it.get("arguments")
        if isinstance(raw, str):
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raw = "{}"
        elif isinstance(raw, dict):
            raw = orjson.dumps(raw).decode()
        else:
            raw = "{}"
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": it.get("call_id") or it.get("id"),
                    "type": "function",
                    "function": {"name": it.get("name"), "arguments": raw},
                }
            ],
        }
    if t == "function_call_output":
        out = it.get("output", "")
        if isinstance(out, list):
            out = "".join(p.get("text", "") for p in out if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": it.get("call_id"), "content": out}
    if t == "reasoning":
        texts = [e["text"] for e in it.get("summary") or [] if e.get("text")]
        if not texts:
            texts = [e["text"] for e in it.get("content") or [] if e.get("text")]
        if not texts:
            return None
        return {"role": "assistant", "reasoning_content": "\n".join(texts)}
    content = it.get("content")
    drop = ("id", "status", "type")
    if not isinstance(content, list):
        return {k: v for k, v in it.items() if v is not None and k not in drop}
    parts = [
        {"type": "text", "text": p.get("text", "")} if p.get("type") in ("input_text", "output_text") else p
        for p in content
    ]
    return {k: v for k, v in {**it, "content": parts}.items() if v is not None and k not in drop}


def _merge_assistant(msgs: list[dict]) -> list[dict]:
    merged: list[dict] = []
    for m in msgs:
        if (
            m.get("role") == "assistant"
            and merged
            and merged[-1].get("role") == "assistant"
            and (
                merged[-1].get("phase") == m.get("phase") or set(merged[-1]) == {"role", "reasoning_content"}
            )
        ):
            prev = merged[-1] = dict(merged[-1])
            if m.get("phase") is not None:
                prev["phase"] = m["phase"]
            new = m.get("content")
            if new is not None and new != "":
                old = prev.get("content")
                if old is None or old == "":
                    prev["content"] = new
                elif isinstance(old, str) and isinstance(new, str):
                    prev["content"] = old + ("\n\n" if old and new else "") + new
                else:

                    def parts(c):
                        if isinstance(c, list):
                            return list(c)
                        return [{"type": "text", "text": c}] if isinstance(c, str) and c else []

                    prev["content"] = parts(old) + parts(new)
            if m.get("tool_calls"):
                prev["tool_calls"] = (prev.get("tool_calls") or []) + list(m["tool_calls"])
            if m.get("reasoning_content"):
                r = prev.get("reasoning_content")
                prev["reasoning_content"] = f"{r}\n{m['reasoning_content']}" if r else m["reasoning_content"]
            continue
        merged.append(m)
    return merged


def to_chat(body: dict[str, Any], inline_system: bool) -> ChatRequest:
    """The Chat Completions request SGLang makes of a valid Responses ``body``."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    for it in items:
        n = _normalize(it)
        if n is not None:
            msgs.append(n)
    msgs = _merge_assistant(msgs)
    if not inline_system:
        chunks: list[str] = []
        rest = []
        for m in msgs:
            if m.get("role") == "system":
                c = m.get("content")
                if isinstance(c, str):
                    chunks.append(c)
                elif isinstance(c, list):
                    chunks += [p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)]
            else:
                rest.append(m)
        msgs = ([{"role": "system", "content": "\n\n".join(chunks)}] if chunks else []) + rest
    tools = [
        tool_dump(t["name"], t.get("description"), t.get("parameters"), bool(t.get("strict", False)))
        for t in body.get("tools") or []
        if t.get("type") == "function"
    ]
    tc = body.get("tool_choice", "auto")
    if isinstance(tc, dict):
        tc = {"name": tc.get("name") or (tc.get("function") or {}).get("name")}
    choice = tc if tools else "none"
    ctk = dict(body.get("chat_template_kwargs") or {}) or None
    r = body.get("reasoning") or {}
    effort = r.get("effort")
    if effort == "none":
        ctk = {"thinking": False, "enable_thinking": False, **(ctk or {})}
    stop = body.get("stop")
    return ChatRequest(
        messages=msgs,
        tools=tools,
        tool_choice=choice,
        reasoning_effort=effort,
        chat_template_kwargs=ctk,
        max_tokens=body.get("max_output_tokens"),
        stop=[stop] if isinstance(stop, str) else stop,
        stream=bool(body.get("stream")),
    )
