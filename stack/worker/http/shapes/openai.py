"""OpenAI's chat and text completions: the objects, their streamed chunks, ``usage``.

The two endpoints differ only in their id prefix, object names and the shape of a choice;
:class:`ChatCompletions` and :class:`TextCompletions` hold exactly those differences, and the
object, chunk and stream builders below are written once for both. SGLang 0.5.23's extras,
where and when it sends them (:class:`Extras`): ``matched_stop`` on a choice; ``meta_info``
on the choice of a non-streamed chat answer whose body asks ``return_meta_info: true``, never
on a stream (SGLang refuses the flag there) nor on ``/v1/completions``; ``sglext.
cached_tokens_details`` (``device``: local hits, ``storage``: global-tier hits, with a global
tier) when the body asks ``return_cached_tokens_details: true``, on the object or, streamed,
in a chunk of its own before the ``usage`` chunk. A forced tool call (:mod:`stack.worker.
tool_calls`, :attr:`Head.call`) is the chat message's ``tool_calls`` (``content`` null,
``finish_reason: tool_calls``); streamed, a first delta with the call's id and name, then its
``arguments`` piece by piece.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from stack.worker.http.encoding import SSE_DONE, data_event, error_object
from stack.worker.http.relay import Completion, failure
from stack.worker.tool_calls import ToolCall


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``usage`` (with ``cached_tokens``: local + global prefix hits)."""
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
    }


def finish_reason(meta: dict[str, Any], called: bool = False) -> str:
    """SGLang's ``finish_reason.type`` in OpenAI's words (``length``, ``abort``, else ``stop``;
    ``tool_calls`` for an answer that ``called`` a tool)."""
    fr = (meta.get("finish_reason") or {}).get("type")
    return {"length": "length", "abort": "abort"}.get(fr, "tool_calls" if called else "stop")


def tool_call_object(call: ToolCall, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One entry of ``tool_calls`` (``index`` only on a streamed delta, as SGLang sends it)."""
    out: dict[str, Any] = {"id": call.id, "type": "function"}
    if index is not None:
        out["index"] = index
    out["function"] = {"name": call.name, "arguments": arguments}
    return out


def cached_tokens_details(meta: dict[str, Any], storage_backend: str | None) -> dict[str, Any]:
    """SGLang's ``cached_tokens_details``: hits from the device cache (the emulator's local
    prefix cache) and the host cache (none here), plus the storage tier's (the emulator's
    global tier) when there is one."""
    local = meta.get("cached_tokens_local", meta.get("cached_tokens", 0))
    out: dict[str, Any] = {"device": int(local), "host": 0}
    glob = int(meta.get("cached_tokens_global", 0))
    if storage_backend or glob:  # a PD decode half reports its prefill twin's global hits
        out["storage"] = glob
        out["storage_backend"] = storage_backend or "mooncake"
    return out


@dataclass(frozen=True)
class Extras:
    """Which of SGLang's extras an answer carries (from the request body; :func:`extras`)."""

    #: ``meta_info`` on the choice (chat, non-streamed, ``return_meta_info``)
    meta_info: bool = False
    #: ``sglext.cached_tokens_details`` (``return_cached_tokens_details``); the value names
    #: the storage backend, "" without a global tier
    cached_details: bool = False
    storage_backend: str = ""


def extras(kind: CompletionKind, body: dict[str, Any], storage_backend: str | None) -> Extras:
    """The extras ``body`` asks for, as SGLang answers them on ``kind``'s endpoint. Raises
    ``ValueError`` where SGLang refuses the body (``return_meta_info`` on a stream)."""
    want_meta = bool(body.get("return_meta_info")) and kind is CHAT
    if want_meta and body.get("stream"):
        raise ValueError(
            "return_meta_info cannot be combined with stream=true: send stream=false to get meta_info"
        )
    return Extras(want_meta, bool(body.get("return_cached_tokens_details")), storage_backend or "")


def matched_stop(meta: dict[str, Any]) -> Any:
    """The stop string (or token) that ended generation, if one did (SGLang's extension)."""
    return (meta.get("finish_reason") or {}).get("matched")


@dataclass(frozen=True)
class Head:
    """What every object and chunk of one request repeats."""

    id: str
    created: int
    model: str
    #: the tool call the request forces (chat only), or None
    call: ToolCall | None = None

    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class CompletionKind(Protocol):
    """What distinguishes one OpenAI completion endpoint's answers from another's."""

    id_prefix: str
    object: str
    chunk_object: str

    def choice(self, text: str, meta: dict[str, Any], call: ToolCall | None = None) -> dict[str, Any]:
        """The choice of the non-streamed object (``call``: the forced tool call)."""
        ...

    def token_choice(self, text: str, first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        """The choice of a streamed chunk carrying one token."""
        ...

    def done_choice(self, meta: dict[str, Any], first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        """The choice of the final streamed chunk (``first``: no token was sent before it)."""
        ...


class ChatCompletions:
    """``/v1/chat/completions``: an assistant ``message``; streamed as ``delta``s."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, text: str, meta: dict[str, Any], call: ToolCall | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        called = call is not None and call.complete(text)
        if called:
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call_object(call, text)]}
        return {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason(meta, called),
            "matched_stop": matched_stop(meta),
        }

    def token_choice(self, text: str, first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        if call is not None:  # the call's id and name open it, its arguments follow
            if first:
                delta: dict[str, Any] = {"role": "assistant", "tool_calls": [tool_call_object(call, text, 0)]}
            else:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    def done_choice(self, meta: dict[str, Any], first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": {"role": "assistant", "content": ""} if first else {},
            "logprobs": None,
            "finish_reason": finish_reason(meta, call is not None and not first),
        }


class TextCompletions:
    """``/v1/completions``: a ``text`` choice, streamed as text pieces."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, text: str, meta: dict[str, Any], call: ToolCall | None = None) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(meta),
            "matched_stop": matched_stop(meta),
        }

    def token_choice(self, text: str, first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def done_choice(self, meta: dict[str, Any], first: bool, call: ToolCall | None = None) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(meta)}


CHAT = ChatCompletions()
TEXT = TextCompletions()


def head(kind: CompletionKind, rid: str, model: str, call: ToolCall | None = None) -> Head:
    """The id (``chatcmpl-<rid>`` / ``cmpl-<rid>``), creation time and model of an answer, and
    the tool call it forces."""
    return Head(id=kind.id_prefix + rid, created=int(time.time()), model=model, call=call)


def completion_object(kind: CompletionKind, h: Head, c: Completion, ex: Extras = Extras()) -> dict[str, Any]:
    """The non-streamed answer: one choice (with SGLang's ``meta_info`` when asked), ``usage``,
    and ``sglext`` when asked."""
    choice = kind.choice(c.text, c.meta, h.call)
    if ex.meta_info:
        choice["meta_info"] = c.meta
    extra: dict[str, Any] = {"usage": usage(c.meta)}
    if ex.cached_details:
        extra["sglext"] = {"cached_tokens_details": cached_tokens_details(c.meta, ex.storage_backend)}
    return h.envelope(kind.object, [choice], **extra)


class CompletionStream:
    """A streamed answer: a chunk per token, a final chunk with ``finish_reason``, an
    ``sglext`` chunk when the body asks ``return_cached_tokens_details``, a ``usage`` chunk
    when ``stream_options.include_usage`` asks, ``[DONE]``."""

    def __init__(self, kind: CompletionKind, h: Head, include_usage: bool, ex: Extras = Extras()) -> None:
        self.kind = kind
        self.head = h
        self.include_usage = include_usage
        self.extras = ex
        self.first = True

    def on_token(self, token_id: int, text: str) -> list[bytes]:
        choice = self.kind.token_choice(text, self.first, self.head.call)
        self.first = False
        return [data_event(self.head.envelope(self.kind.chunk_object, [choice]))]

    def on_done(self, meta: dict[str, Any]) -> list[bytes]:
        if (failed := failure(meta)) is not None:  # SGLang streams an error event, then [DONE]
            return [data_event({"error": error_object(failed[1], failed[0])})]
        done = self.kind.done_choice(meta, self.first, self.head.call)
        last = self.head.envelope(self.kind.chunk_object, [done])
        out = [data_event(last)]
        ex = self.extras
        if ex.cached_details:
            ext = {"cached_tokens_details": cached_tokens_details(meta, ex.storage_backend)}
            out.append(data_event(self.head.envelope(self.kind.chunk_object, [], sglext=ext)))
        if self.include_usage:
            out.append(data_event(self.head.envelope(self.kind.chunk_object, [], usage=usage(meta))))
        return out

    def on_close(self) -> list[bytes]:
        return [SSE_DONE]


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    """``/v1/models``: the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": model,
                "max_model_len": max_model_len,
            }
        ],
    }
