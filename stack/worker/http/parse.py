"""Request bodies in, engine inputs out: JSON reading, validation and prompt tokenizing.

Every function raises ``ValueError`` (or ``TypeError``, for values of the wrong type) with the
message the client sees; the routes turn both into :func:`~stack.worker.http.encoding.error_response`
(SGLang's 400 body), so a validation rule lives in exactly one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from fastapi import Request

from stack.worker.engine import GenParams, Req
from stack.worker.http.tracing import annotate
from stack.worker.request import request_priority
from stack.worker.request_path import Worker


class PromptEncoder(Protocol):
    """What parsing needs of a tokenizer (``stack.worker.tokenizer``'s built-in or HF one)."""

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, body: dict) -> list[int]: ...


Parsed = tuple[list[int], GenParams]
"""What a body parser returns: the prompt's token ids and the generation parameters."""


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (generation endpoints accept no other top-level value)."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as ex:
        raise ValueError(f"invalid JSON body: {ex}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def stop_list(v: Any) -> list[str]:
    """``stop`` as SGLang and OpenAI accept it (a string or a list of them); non-strings are
    dropped rather than rejected."""
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [x for x in v if isinstance(x, str)]


def bootstrap_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The PD fields of a body, as ``Req`` takes them (absent: a request served alone)."""
    room = body.get("bootstrap_room")
    if isinstance(room, list):
        raise ValueError("batched bodies (lists of bootstrap_room) are not supported by the emulator")
    port = body.get("bootstrap_port")
    return {
        "bootstrap_host": body.get("bootstrap_host"),
        "bootstrap_port": int(port) if port is not None else None,
        "bootstrap_room": int(room) if room is not None else None,
    }


def _optional_int(v: Any) -> int | None:
    return int(v) if v is not None else None


def prompt_tokens(prompt: Any, tokenizer: PromptEncoder) -> list[int]:
    """A completions ``prompt``: token ids as given, or a string to tokenize."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    raise ValueError("prompt must be a string or a list of token ids")


# -- SGLang native ---------------------------------------------------------------------------------
def parse_generate(body: dict[str, Any], tokenizer: PromptEncoder) -> Parsed:
    """``/generate``: ``text`` or ``input_ids`` (one request, not a batch) and ``sampling_params``
    (``max_new_tokens`` defaults to SGLang's 128)."""
    sp = body.get("sampling_params") or {}
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            raise ValueError("batched input_ids are not supported by the emulator")
        tokens = list(ids)
    elif isinstance(body.get("text"), str):
        tokens = tokenizer.encode_prompt(body["text"])
    else:
        raise ValueError("`text` (a string) or `input_ids` is required (batches are not supported)")
    params = GenParams(
        max_new_tokens=_optional_int(sp.get("max_new_tokens", 128)),
        stop=stop_list(sp.get("stop")),
        ignore_eos=bool(sp.get("ignore_eos", False)),
    )
    return tokens, params


# -- OpenAI ------------------------------------------------------------------------------------------
def _openai_params(body: dict[str, Any], default_max_tokens: int | None) -> GenParams:
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is None:
        mt = default_max_tokens
    return GenParams(
        max_new_tokens=_optional_int(mt),
        stop=stop_list(body.get("stop")),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def parse_chat(body: dict[str, Any], tokenizer: PromptEncoder) -> Parsed:
    """``/v1/chat/completions``: a non-empty ``messages`` list through the chat template; no
    ``max_tokens`` means until EOS (or the context's end)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("`messages` must be a non-empty list")
    return tokenizer.encode_chat(body), _openai_params(body, None)


def parse_completion(body: dict[str, Any], tokenizer: PromptEncoder) -> Parsed:
    """``/v1/completions``: ``prompt`` is required; ``max_tokens`` defaults to OpenAI's 16."""
    if "prompt" not in body:
        raise ValueError("`prompt` is required")
    return prompt_tokens(body["prompt"], tokenizer), _openai_params(body, 16)


def parse_embedding_input(body: dict[str, Any], tokenizer: PromptEncoder) -> list[list[int]]:
    """``/v1/embeddings``: ``input`` is a string, a list of strings, a list of token ids, or a
    list of lists of token ids (non-empty); one token-id list per prompt."""
    inp = body.get("input")
    if isinstance(inp, str):
        inp = [inp]
    if not isinstance(inp, list) or not inp:
        raise ValueError("`input` must be a non-empty string or list")
    if all(_is_id(t) for t in inp):
        return [list(inp)]
    if all(isinstance(x, str) and x for x in inp):
        return [tokenizer.encode_prompt(x) for x in inp]
    if all(isinstance(x, list) and x and all(_is_id(t) for t in x) for x in inp):
        return [list(x) for x in inp]
    raise ValueError("`input` must hold only non-empty strings, or only non-empty lists of token ids")


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


# -- body to Req -----------------------------------------------------------------------------------
BodyParser = Callable[[dict[str, Any], PromptEncoder], Parsed]


async def admit(request: Request, worker: Worker, parse: BodyParser) -> tuple[dict[str, Any], Req]:
    """Read and validate a generation request and make its ``Req`` (``rid`` and the PD fields
    come from the body whatever the API). The clock starts before the body is read: TTFT
    counts parsing and tokenizing, as SGLang's does."""
    t_arrive = time.monotonic()
    body = await read_body(request)

    priority = request_priority(body, request.headers)  # SGLang's, honoured by the scheduler

    def build() -> Req:  # off the event loop: tokenizing (GIL released) and page hashing of a
        # long prompt would stall every other request of this worker (and of its pool)
        tokens, params = parse(body, worker.engine.tokenizer)
        req = worker.make_req(
            tokens, params, rid=body.get("rid"), t_arrive=t_arrive, **bootstrap_fields(body)
        )
        req.priority = priority
        return req

    req = await asyncio.to_thread(build)
    annotate(request.scope, req.rid, req.L, req.bootstrap_room)
    return body, req
