"""Tool calls as the emulated worker makes them, in the shapes SGLang answers them.

A real SGLang worker answers a tool call only when it runs with a tool-call parser
(``--tool-call-parser``, e.g. ``qwen3_coder``); without one the model's call comes back as
plain text. With a parser and a request whose ``tool_choice`` forces a call (OpenAI
``required`` or a named function; Anthropic ``any`` or ``tool``, which SGLang converts to
those two), SGLang constrains the output to a call and its parser turns it into the API's
call objects: ``tool_calls`` on the chat message (``finish_reason: tool_calls``), ``tool_use``
blocks in Messages (``stop_reason: tool_use``), a ``function_call`` output item in Responses.

The emulator has no model to choose a call, so it calls only when the request forces one
(``tool_choice: auto`` answers text, as a random-weight model does): the named tool, else the
first one, with arguments that satisfy the tool's schema (:func:`example`). The output
tokens spell the arguments' JSON text (:func:`pieces`), so a stream carries them as argument
deltas and ``max_tokens`` can cut them short (``finish_reason: length``, as it would cut a
real model's call).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

#: characters per emulated output token of a call's arguments
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class ToolCall:
    """One forced call: its id (SGLang's ``call_<24 hex>``), the tool and the arguments' JSON."""

    id: str
    name: str
    arguments: str

    def complete(self, text: str) -> bool:
        """Whether ``text`` (the generated output) holds the whole call, not one cut short."""
        return text == self.arguments


def forced_call(tools: Any, tool_choice: Any, parser: str | None, rid: str, seed: int) -> ToolCall | None:
    """The call a request forces, or None (no parser, no tools, or ``tool_choice`` not forcing).
    The id is a function of the request id (both halves of a PD pair name the call alike), the
    arguments of ``seed``.

    ``tools`` are chat function tools (``{"type": "function", "function": {name, parameters}}``,
    the shape :mod:`stack.agent_apis` converts every API's tools to); ``tool_choice`` is
    ``"required"``, ``{"type": "function", "function": {"name": N}}`` (or ``{"name": N}``), or
    anything else for no forced call."""
    if not parser or not tools or not isinstance(tools, list):
        return None
    functions = [f for t in tools if isinstance(t, dict) and isinstance(f := t.get("function") or t, dict)]
    if not functions:
        return None
    if tool_choice == "required":
        fn = functions[0]
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or tool_choice).get("name")
        fn = next((f for f in functions if f.get("name") == name), None)
        if fn is None:
            return None
    else:
        return None
    digest = hashlib.sha256(f"{rid}:{fn.get('name')}".encode()).hexdigest()
    args = example(fn.get("parameters") or {"type": "object", "properties": {}}, seed)
    return ToolCall(f"call_{digest[:24]}", str(fn.get("name")), json.dumps(args, separators=(", ", ": ")))


def example(schema: Any, seed: int = 0, depth: int = 0) -> Any:
    """A small value that satisfies ``schema`` (the JSON-schema subset tools use): an object
    with its required properties (all of them when none is marked required), the first
    ``enum`` / ``const`` value, the type's plain value otherwise; deterministic in ``seed``."""
    if not isinstance(schema, dict) or depth > 8:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example(schema[key][0], seed, depth + 1)
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null")
    if t is None:
        t = "object" if "properties" in schema else "string"
    if t == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required")
        names = [n for n in required if n in props] if isinstance(required, list) else list(props)
        return {n: example(props[n], seed + i, depth + 1) for i, n in enumerate(names)}
    if t == "array":
        n = max(int(schema.get("minItems") or 0), 1)
        return [example(schema.get("items") or {}, seed + i, depth + 1) for i in range(n)]
    if t == "string":
        n = max(int(schema.get("minLength") or 0), 6)
        return ("s" + format(seed & 0xFFFFFFFF, "x") * n)[:n]
    if t == "integer":
        return max(int(schema.get("minimum") or 0), 0) + seed % 7
    if t == "number":
        return float(max(schema.get("minimum") or 0, 0)) + 0.5
    if t == "boolean":
        return bool(seed & 1)
    return None


def pieces(arguments: str) -> list[str]:
    """The output tokens' text of a call: its arguments in :data:`CHARS_PER_TOKEN`-character pieces."""
    return [arguments[i : i + CHARS_PER_TOKEN] for i in range(0, len(arguments), CHARS_PER_TOKEN)] or [""]
