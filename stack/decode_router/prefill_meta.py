"""The prefill half's timings (``router.cost_model: observe | learn``): the request that asks
SGLang for its ``meta_info`` and the reading of it off the prefill worker's answer.

An Anthropic Messages request's prefill half goes to the prefill worker as the Chat Completions
request SGLang itself makes of it: SGLang 0.5.23's ``/v1/messages``
(``AnthropicServing._convert_to_chat_completion_request``, then
``OpenAIServingChat.handle_request``) builds a ``ChatCompletionRequest`` from the body and runs
its chat path, so that request, sent to ``/v1/chat/completions`` with ``return_meta_info``,
renders the same prompt token for token (and samples with the same parameters), and its answer
carries ``meta_info``. Only where the conversion does not depend on what the router cannot see
(the worker's template: an inline ``system`` message; its reasoning parser: ``thinking``) and
carries nothing a chat body cannot carry the same (``output_config``): otherwise the
prefill half keeps the client's body, unobserved. Checked against SGLang's own code:
tests/integration/test_prefill_chat_sglang.py.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from stack.agent_apis import anthropic
from stack.decode_router.bodies import batch_size

#: how much of the prefill half's answer is kept to read its ``meta_info``
KEEP_BYTES = 1 << 20


class PrefillObserver(Protocol):
    """Reads prefill timings off prefill halves' answers
    (:class:`stack.prefill_router.learned_cost.CostLearner`)."""

    def begin(self, worker: str, observed: bool) -> Any: ...

    def record(self, ticket: Any, meta: Any) -> Any: ...

    def end(self, ticket: Any) -> None: ...


def meta_body(path: str, data: bytes, body: dict) -> bytes | None:
    """The prefill half's body asking for SGLang's ``meta_info``, or None where the path gives
    none: native ``/generate`` answers with it as it is; a chat completion goes to the prefill
    worker non-streamed with ``return_meta_info`` (SGLang refuses that flag on a stream); the
    decode half keeps the client's body. Other paths (``/v1/completions`` never carries it,
    Anthropic, Responses) and batched bodies: None."""
    if batch_size(body) is not None:
        return None
    if path == "/generate":
        return data
    if path != "/v1/chat/completions":
        return None
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    d["stream"] = False
    d.pop("stream_options", None)
    d["return_meta_info"] = True
    return orjson.dumps(d)


#: body fields of a Messages request that go unchanged into SGLang's chat request
_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k")
#: the PD and request-id fields the router adds (:func:`stack.decode_router.bodies.pd_body`)
_CARRIED = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid", "priority")


def meta_request(path: str, data: bytes, body: dict) -> tuple[str, bytes] | None:
    """The prefill half's (path, body) that asks for ``meta_info`` (:func:`meta_body`; a Messages
    request: :func:`messages_as_chat` to ``/v1/chat/completions``), or None where none gives
    the same tokens (the prefill half then keeps the client's path and body)."""
    if path == "/v1/messages":
        chat = messages_as_chat(data)
        return None if chat is None else ("/v1/chat/completions", chat)
    out = meta_body(path, data, body)
    return None if out is None else (path, out)


def messages_as_chat(data: bytes) -> bytes | None:
    """A Messages body (with the router's PD fields) as the chat request SGLang makes of it,
    non-streamed with ``return_meta_info``; None when the body is not valid or its conversion
    depends on the worker (an inline system message, ``thinking``) or sets what a chat body
    cannot carry the same (``output_config``: SGLang sets ``reasoning_effort`` after building
    its request, so its chat body's validator never derives the thinking template kwargs that
    a chat body with ``reasoning_effort`` gets; ``format``: a grammar)."""
    try:
        d = orjson.loads(data)
        if not isinstance(d, dict) or d.get("thinking") is not None:
            return None
        oc = d.get("output_config")
        if oc is not None and (not isinstance(oc, dict) or set(oc) - {"task_budget"}):
            return None
        msgs = d.get("messages")
        if not isinstance(msgs, list) or any(isinstance(m, dict) and m.get("role") == "system" for m in msgs):
            return None
        anthropic.validate(d)
        req = anthropic.to_chat(d, True)  # no inline system message: the template's support is moot
    except Exception:  # noqa: BLE001 - a body we cannot convert (invalid: 400 from decode) is sent as it is
        return None
    out: dict[str, Any] = {k: d[k] for k in _SAMPLING if d.get(k) is not None}
    out["messages"] = req.messages
    if d.get("stop_sequences") is not None:
        out["stop"] = d["stop_sequences"]
    if req.tools:
        out["tools"] = req.tools
        out["tool_choice"] = _tool_choice(req.tool_choice)
    tc = d.get("tool_choice")
    if isinstance(tc, dict) and "disable_parallel_tool_use" in tc:
        out["parallel_tool_calls"] = not tc["disable_parallel_tool_use"]
    if req.reasoning_effort is not None:
        out["reasoning_effort"] = req.reasoning_effort
    if req.chat_template_kwargs:
        out["chat_template_kwargs"] = req.chat_template_kwargs
    out.update({k: d[k] for k in _CARRIED if k in d})
    out["stream"] = False
    out["return_meta_info"] = True
    return orjson.dumps(out)


def _tool_choice(tc: Any) -> Any:
    """A converted ``tool_choice`` in chat's wire form (a named tool: ``{"type": "function",
    "function": {"name": ...}}``)."""
    if isinstance(tc, dict):
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def answer_meta(raw: bytes) -> dict | None:
    """The ``meta_info`` of a prefill half's answer: a JSON body's (native, or on its first
    choice), or a stream's last event that has one."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
        for line in reversed(raw.split(b"\n")):
            if line.startswith(b"data:") and b"meta_info" in line:
                try:
                    obj = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                break
    if not isinstance(obj, dict):
        return None
    meta = obj.get("meta_info")
    if meta is None:
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            meta = choices[0].get("meta_info")
    return meta if isinstance(meta, dict) else None
