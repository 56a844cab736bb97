"""The OpenAI-shaped endpoints' fields, validated as the APIs define them (OpenAI's chat and
completions, SGLang's ``/generate``): every mistake is a :class:`ClientError` (400) naming the
field, as OpenAI and SGLang answer it, before anything is routed.

- ``n``: an integer of at least 1; above 1 is refused (400): a PD hand-off carries one
  sequence per request, so more choices would be silently dropped;
- token limits (``max_tokens``, ``max_completion_tokens``; ``/generate``'s
  ``sampling_params.max_new_tokens`` and ``min_new_tokens``): non-negative integers;
- chat roles (:func:`~stack.prefill_router.features.check_messages`): ``system``,
  ``developer``, ``user``, ``assistant``, ``tool``, ``function``;
- chat ``tools``: function tools (``type`` ``function``, ``function.name`` as OpenAI's
  pattern ``^[a-zA-Z0-9_-]{1,64}$``, ``description`` a string, ``parameters`` an object,
  ``strict`` a boolean);
- chat ``tool_choice``: ``none``, ``auto``, ``required`` (with tools), or a function named
  among the tools.
"""

from __future__ import annotations

import re

from stack.prefill_router.errors import ClientError

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(param: str, message: str, code: str = "invalid_value") -> ClientError:
    return ClientError(f"Invalid '{param}': {message}", param=param, code=code)


def check_count(v, param: str = "n") -> None:
    """``n`` (choices per request): 1 or left out."""
    if v is None:
        return
    if not _is_int(v):
        raise _bad(param, "expected an integer", "invalid_type")
    if v < 1:
        raise _bad(param, f"integer below minimum value: expected at least 1, got {v}")
    if v > 1:
        raise _bad(
            param,
            f"{v} choices per request are not supported by this router (a PD hand-off carries one "
            "sequence): send n=1, once per choice wanted",
            "unsupported_value",
        )


def check_limit(v, param: str) -> None:
    """A token limit: a non-negative integer, or left out."""
    if v is None:
        return
    if not _is_int(v):
        raise _bad(param, "expected an integer", "invalid_type")
    if v < 0:
        raise _bad(param, f"integer below minimum value: expected at least 0, got {v}")


def check_tools(tools) -> list[str]:
    """Chat ``tools`` (None: none); returns the names of its functions."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools", "expected an array of tools", "invalid_type")
    names = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(p, "expected an object", "invalid_type")
        kind = t.get("type", "function")
        if kind != "function":
            raise _bad(f"{p}.type", f"{str(kind)[:40]!r} tools are not supported: 'function' expected")
        names.append(_check_function(t.get("function"), f"{p}.function"))
    return names


def _check_function(fn, p: str) -> str:
    if not isinstance(fn, dict):
        raise _bad(p, "expected an object with a 'name'", "invalid_type")
    name = fn.get("name")
    if not isinstance(name, str):
        raise _bad(f"{p}.name", "expected a string", "invalid_type")
    if not _TOOL_NAME.fullmatch(name):
        raise _bad(f"{p}.name", "a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _bad(f"{p}.description", "expected a string", "invalid_type")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise _bad(f"{p}.parameters", "expected an object (a JSON Schema)", "invalid_type")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{p}.strict", "expected a boolean", "invalid_type")
    return name


def check_tool_choice(tc, names: list[str], has_tools: bool) -> None:
    """Chat ``tool_choice`` against the functions ``names`` of ``tools``."""
    if tc is None:
        return
    if isinstance(tc, str):
        if tc not in _CHOICES:
            raise _bad("tool_choice", f"{tc[:40]!r}: one of none, auto, required, or a named function")
        if tc == "required" and not has_tools:
            raise _bad("tool_choice", "'required' needs 'tools'")
        return
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(tc.get("function"), dict):
        raise _bad(
            "tool_choice", "expected none, auto, required or {'type': 'function', 'function': {'name'}}"
        )
    name = tc["function"].get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice.function.name", "expected a string", "invalid_type")
    if name not in names:
        raise _bad("tool_choice", f"function {name[:64]!r} is not among the tools")


def check_chat_fields(body: dict) -> None:
    """The chat endpoint's own fields (beyond :func:`check_sampling`): tools and tool_choice."""
    tools = body.get("tools")
    names = check_tools(tools)
    check_tool_choice(body.get("tool_choice"), names, bool(tools))
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise _bad("parallel_tool_calls", "expected a boolean", "invalid_type")


def check_sampling(body: dict) -> None:
    """``n`` and the token limits of a chat or completions body."""
    check_count(body.get("n"))
    for key in ("max_tokens", "max_completion_tokens"):
        check_limit(body.get(key), key)


def check_generate_params(sp: dict) -> None:
    """``/generate``'s ``sampling_params``: its token limits and ``n``."""
    for key in ("max_new_tokens", "min_new_tokens"):
        check_limit(sp.get(key), f"sampling_params.{key}")
    check_count(sp.get("n"), "sampling_params.n")
