"""SGLang's chat step, after an agent request became a Chat Completions request.

SGLang (0.5.23, ``OpenAIServingChat._process_messages`` / ``_apply_jinja_template``) does not
hand the converted messages to the chat template as they are: they go through its pydantic
message models (``model_dump``), assistant tool-call ``arguments`` are parsed into objects,
list contents are normalized for the template's *content format* (``openai``: a list of
text parts; ``string``: the texts joined by spaces, detected from the template's AST),
``None`` fields are dropped, a tool message's text parts are joined, and a trailing
assistant message with string content is turned into a user message. Tools go to the
template as ``Tool.model_dump()`` (``{"type", "function", "defer_loading"}``) unless
``tool_choice`` is ``"none"``; a named ``tool_choice`` renders only that tool. This module
does the same to the dicts our converters produce, so the router renders exactly SGLang's
prompt. (Media parts never get here: the agent converters refuse images.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from stack.agent_apis.errors import AgentError

#: the keys of SGLang's ChatCompletionMessageGenericParam, in field order (user messages: role, content)
_GENERIC_KEYS = ("role", "content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls")


@dataclass
class ChatRequest:
    """A converted request: chat messages and tools as SGLang builds them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # Tool.model_dump() shape
    tool_choice: Any = "auto"  # "auto" | "none" | "required" | {"name": ...}
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    stream: bool = False


def tool_dump(name: str, description, parameters, strict) -> dict[str, Any]:
    """``Tool(type="function", function={...}).model_dump()``: the function's keys in the order
    given (``strict``/``defer_loading`` dropped when None), ``defer_loading: None`` outside."""
    fn = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn, "defer_loading": None}


@lru_cache(maxsize=16)
def content_format(template: str | None) -> str:
    """SGLang's ``detect_jinja_template_content_format``: ``openai`` when the template loops
    over a message's content (or mentions media), else ``string``."""
    if not template:
        return "string"
    if any(k in template for k in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        ast = env.parse(template)
    except Exception:
        return "string"

    def var(n, name):
        return isinstance(n, nodes.Name) and n.ctx == "load" and n.name == name

    def attr(n, name, key):
        if isinstance(n, nodes.Getitem):
            return var(n.node, name) and isinstance(n.arg, nodes.Const) and n.arg.value == key
        if isinstance(n, nodes.Getattr):
            return var(n.node, name) and n.attr == key
        return False

    def access(n, name, key):
        if isinstance(n, nodes.Filter):
            return n.node is not None and access(n.node, name, key)
        if isinstance(n, nodes.Test):
            return access(n.node, name, key)
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice):
            return access(n.node, name, key)
        return attr(n, name, key)

    try:
        for loop in ast.find_all(nodes.For):
            if any(access(loop.iter, v, "content") for v in ("message", "msg", "m")):
                return "openai"
    except Exception:
        return "string"
    return "string"


@lru_cache(maxsize=16)
def inline_system(template: str | None) -> bool:
    """SGLang's ``detect_inline_system_support``: does a mid-conversation system message
    render (else the converters merge every system text into the leading one)."""
    if not template:
        return False
    sentinel = "__sglang_inline_system_sentinel__"
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        out = env.from_string(template).render(
            messages=[
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
                {"role": "system", "content": sentinel},
                {"role": "user", "content": "t"},
            ],
            add_generation_prompt=False,
        )
        return sentinel in out
    except Exception:
        return False


def _dump_part(p: dict[str, Any]) -> dict[str, Any]:
    t = p.get("type")
    if t == "text":
        return {"type": "text", "text": p["text"]}
    if t == "tool_reference":
        return {"type": "tool_reference", "name": p["name"]}
    return dict(p)


def _dump_message(m: dict[str, Any]) -> dict[str, Any]:
    """``msg.model_dump()`` with its None fields already dropped (SGLang drops them next)."""
    c = m.get("content")
    content = [_dump_part(p) for p in c] if isinstance(c, list) else c
    if m["role"] == "user":
        return {"role": "user", "content": content}
    out: dict[str, Any] = {}
    for k in _GENERIC_KEYS:
        if k == "content":
            out["content"] = content
        elif k == "tool_calls" and m.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": tc.get("id"),
                    "index": None,
                    "type": "function",
                    "function": {
                        "name": tc["function"].get("name"),
                        "arguments": tc["function"].get("arguments"),
                    },
                }
                for tc in m["tool_calls"]
            ]
        elif m.get(k) is not None:
            out[k] = m[k]
    return out


def _parse_arguments(m: dict[str, Any]) -> None:
    if m.get("role") != "assistant" or not isinstance(m.get("tool_calls"), list):
        return
    for tc in m["tool_calls"]:
        fn = tc["function"]
        if isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise AgentError("Assistant tool call function.arguments must be a JSON object.")
            fn["arguments"] = args


def template_inputs(
    req: ChatRequest, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """(messages, tools, extra template kwargs) exactly as SGLang hands them to the template."""
    fmt = content_format(template)
    out = []
    for m in req.messages:
        d = _dump_message(m)
        _parse_arguments(d)
        if d.get("content") is None:
            d["content"] = ""
        c = d["content"]
        if isinstance(c, list):
            rest = {k: v for k, v in d.items() if v is not None and k != "content"}
            if fmt == "openai":
                parts = [
                    {"type": "text", "text": p["text"]} if p.get("type") == "text" else p
                    for p in c
                    if p.get("type") in ("text", "tool_reference")
                ]
                d = {**rest, "content": parts}
            else:
                texts = [p["text"] for p in c if p.get("type") == "text"]
                d = {**{k: v for k, v in d.items() if v is not None}, "content": " ".join(texts)}
        else:
            d = {k: v for k, v in d.items() if v is not None}
        if d["role"] == "tool" and isinstance(d.get("content"), list):
            parts = d["content"]
            if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                d["content"] = " ".join(p.get("text", "") for p in parts)
        out.append(d)
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1].get("content"), str):
        out[-1] = {"role": "user", "content": out[-1]["content"]}
    tools = None
    if req.tools and req.tool_choice != "none":
        if isinstance(req.tool_choice, dict):
            tools = [t for t in req.tools if t["function"]["name"] == req.tool_choice.get("name")] or None
        else:
            tools = list(req.tools)
    extra: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    if req.chat_template_kwargs:
        extra.update(req.chat_template_kwargs)
    return out, tools, extra


def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """SGLang's second try when the template fails with the tools: the bare functions."""
    return [t["function"] if "function" in t else t for t in tools] if tools else None


def chat_body(req: ChatRequest, template: str | None, flat: bool = False) -> dict[str, Any]:
    """A chat body for the router's feature extractor (``FeatureExtractor.chat``) that renders
    SGLang's prompt: its messages, tools and template kwargs (``flat``: SGLang's retry form of
    the tools)."""
    messages, tools, extra = template_inputs(req, template)
    body: dict[str, Any] = {"messages": messages, "tools": flat_tools(tools) if flat else tools}
    if extra:
        body["chat_template_kwargs"] = extra
    return body
