"""OpenAI Responses (``/v1/responses``) as SGLang answers it (non-harmony models): the
response object, its event stream and ``usage``.

The object: ``object: response``, one ``message`` output item with one ``output_text`` part,
``status`` ``completed`` (``incomplete`` when the token budget ran out, ``failed`` with an
``error`` when the request was aborted; SGLang leaves ``incomplete_details`` unset),
Responses ``usage`` (``input_tokens``,
``input_tokens_details.cached_tokens``, ``output_tokens``, ...). The stream:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed`` (or ``response.incomplete`` / ``response.failed``), each framed ``event: <type>`` with a ``sequence_number``.
A forced tool call (:mod:`stack.worker.tool_calls`) is a ``function_call`` output item (``id``
``fc_...``, ``call_id``, ``name``, ``arguments``) instead of the message; streamed, its
``response.output_item.added`` (empty ``arguments``), ``response.function_call_arguments.delta``
per token, ``response.function_call_arguments.done``, ``response.output_item.done``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from stack.worker.http.relay import Completion
from stack.worker.http.shapes.anthropic import event
from stack.worker.tool_calls import ToolCall


@dataclass(frozen=True)
class Head:
    id: str
    item_id: str
    created_at: int
    model: str
    request: dict  # the client's body (echoed fields)
    call: ToolCall | None = None  # the tool call the request forces


def head(rid: str, model: str, body: dict, call: ToolCall | None = None) -> Head:
    item_id = f"fc_{call.id[5:13]}" if call else f"msg_{rid}"
    return Head(f"resp_{rid}", item_id, int(time.time()), model, body, call)


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _item(h: Head, text: str, status: str) -> dict[str, Any]:
    if h.call is not None:
        c = h.call
        return {
            "type": "function_call",
            "id": h.item_id,
            "call_id": c.id,
            "name": c.name,
            "arguments": text,
            "status": status,
        }
    content = [] if status == "in_progress" else [_part(text)]
    return {
        "id": h.item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
        "phase": "final_answer",
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def response_object(h: Head, text: str | None, meta: dict[str, Any] | None) -> dict[str, Any]:
    """The response: in progress (``meta`` None) or finished."""
    b = h.request
    status, error = "in_progress", None
    if meta is not None:
        fr = meta.get("finish_reason") or {}
        status = {"length": "incomplete", "abort": "failed", "error": "failed"}.get(
            fr.get("type"), "completed"
        )
        if status == "failed":
            error = {"code": "server_error", "message": fr.get("message") or "Generation aborted"}
    return {
        "id": h.id,
        "object": "response",
        "created_at": h.created_at,
        "model": h.model,
        "output": [] if meta is None else [_item(h, text or "", "completed")],
        "status": status,
        "usage": None if meta is None else usage(meta),
        "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "tool_choice": b.get("tool_choice", "auto"),
        "tools": b.get("tools") or [],
        "error": error,
        "incomplete_details": None,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "previous_response_id": None,
        "reasoning": b.get("reasoning"),
        "store": b.get("store"),
        "temperature": b.get("temperature"),
        "text": b.get("text"),
        "top_p": b.get("top_p"),
        "truncation": b.get("truncation", "disabled"),
        "user": b.get("user"),
        "metadata": b.get("metadata"),
    }


def completed_object(h: Head, c: Completion) -> dict[str, Any]:
    return response_object(h, c.text, c.meta)


class ResponseStream:
    def __init__(self, h: Head) -> None:
        self.h = h
        self.seq = 0
        self.text = ""
        self.opened = False

    def _ev(self, type_: str, **fields: Any) -> bytes:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(obj)

    def _open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        h = self.h
        start = response_object(h, None, None)
        added = [
            self._ev("response.created", response=start),
            self._ev("response.in_progress", response=start),
            self._ev("response.output_item.added", output_index=0, item=_item(h, "", "in_progress")),
        ]
        if h.call is not None:
            return added
        return [
            *added,
            self._ev(
                "response.content_part.added",
                item_id=h.item_id,
                output_index=0,
                content_index=0,
                part=_part(""),
            ),
        ]

    def on_token(self, token_id: int, text: str) -> list[bytes]:
        out = self._open()
        self.text += text
        if self.h.call is not None:
            ev = "response.function_call_arguments.delta"
            out.append(self._ev(ev, item_id=self.h.item_id, output_index=0, delta=text))
            return out
        out.append(
            self._ev(
                "response.output_text.delta",
                item_id=self.h.item_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def on_done(self, meta: dict[str, Any]) -> list[bytes]:
        h = self.h
        out = self._open()
        final = response_object(h, self.text, meta)
        end = f"response.{final['status']}"
        if h.call is not None:
            ev = "response.function_call_arguments.done"
            return out + [
                self._ev(ev, item_id=h.item_id, output_index=0, arguments=self.text),
                self._ev("response.output_item.done", output_index=0, item=_item(h, self.text, "completed")),
                self._ev(end, response=final),
            ]
        out += [
            self._ev(
                "response.output_text.done",
                item_id=h.item_id,
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self._ev(
                "response.content_part.done",
                item_id=h.item_id,
                output_index=0,
                content_index=0,
                part=_part(self.text),
            ),
            self._ev("response.output_item.done", output_index=0, item=_item(h, self.text, "completed")),
            self._ev(end, response=final),
        ]
        return out

    def on_close(self) -> list[bytes]:
        return []
