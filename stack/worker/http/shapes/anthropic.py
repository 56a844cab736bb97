"""Anthropic Messages (``/v1/messages``) as SGLang answers it: the message object, its
event stream, ``usage`` and the error envelope.

SGLang builds these from its chat answer (``AnthropicServing._convert_response`` and
``_generate_anthropic_stream``): a ``message`` with one text block (an empty one when the
model said nothing), ``stop_reason`` ``end_turn`` / ``max_tokens``, ``usage`` with
``input_tokens`` = prompt - cached and ``cache_read_input_tokens`` = cached (when any); the
stream is ``message_start`` (empty content, ``output_tokens`` 0), ``content_block_start`` /
``content_block_delta`` (``text_delta``) / ``content_block_stop``, ``message_delta`` (the
stop reason and ``output_tokens``), ``message_stop``, each framed ``event: <type>``. A forced
tool call (:mod:`stack.worker.tool_calls`) is a ``tool_use`` block (id, name, ``input``) with
``stop_reason: tool_use``; streamed, its ``content_block_start`` carries the id, the name and an
empty ``input``, and ``input_json_delta`` events carry the arguments' JSON piece by piece.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

from stack.worker.http.relay import Completion
from stack.worker.tool_calls import ToolCall

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def event(obj: dict[str, Any]) -> bytes:
    """A named SSE frame: ``event: <type>`` then ``data: <json>``."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def stop_reason(meta: dict[str, Any], called: bool = False) -> str:
    fr = (meta.get("finish_reason") or {}).get("type")
    return STOP_REASONS.get(fr, "end_turn") if fr != "stop" or not called else "tool_use"


def tool_use_block(call: ToolCall, text: str | None) -> dict[str, Any]:
    """The ``tool_use`` block of a call (``text``: its arguments' JSON; None: the empty input
    a stream opens the block with)."""
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": orjson.loads(text) if text else {}}


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, cached = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)
    out = {"input_tokens": max(prompt - cached, 0), "output_tokens": meta.get("completion_tokens", 0)}
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


def message_object(mid: str, model: str, c: Completion, call: ToolCall | None = None) -> dict[str, Any]:
    called = call is not None and call.complete(c.text)
    content = [tool_use_block(call, c.text)] if called else [{"type": "text", "text": c.text}]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop_reason(c.meta, called),
        "usage": usage(c.meta),
    }


def error_response(message: str, status: int = 400, type_: str = "invalid_request_error") -> Response:
    body = {"type": "error", "error": {"type": type_, "message": message}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class MessageStream:
    """The event stream of one answer (``prompt_tokens``: for ``message_start``'s usage)."""

    def __init__(self, mid: str, model: str, prompt_tokens: int, call: ToolCall | None = None) -> None:
        self.mid = mid
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.call = call
        self.started = False
        self.block_open = False

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        msg = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return [event({"type": "message_start", "message": msg})]

    def on_token(self, token_id: int, text: str) -> list[bytes]:
        out = self._start()
        call = self.call
        if not self.block_open:
            self.block_open = True
            block = tool_use_block(call, None) if call else {"type": "text", "text": ""}
            out.append(event({"type": "content_block_start", "index": 0, "content_block": block}))
        delta = (
            {"type": "input_json_delta", "partial_json": text}
            if call
            else {"type": "text_delta", "text": text}
        )
        out.append(event({"type": "content_block_delta", "index": 0, "delta": delta}))
        return out

    def on_done(self, meta: dict[str, Any]) -> list[bytes]:
        out = self._start()
        called = self.call is not None and self.block_open
        if self.block_open:
            out.append(event({"type": "content_block_stop", "index": 0}))
            self.block_open = False
        out.append(
            event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(meta, called)},
                    "usage": {"output_tokens": meta.get("completion_tokens", 0)},
                }
            )
        )
        out.append(event({"type": "message_stop"}))
        return out

    def on_close(self) -> list[bytes]:
        return []
