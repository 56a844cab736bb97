"""The prefill half's timings (``router.cost_model: observe | learn``): the body that asks
SGLang for its ``meta_info`` and the reading of it off the prefill worker's answer."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

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
