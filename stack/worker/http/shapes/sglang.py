"""SGLang's native ``/generate`` answer: ``text``, ``output_ids`` and ``meta_info``.

Streamed, every frame carries the text and ids so far (SGLang's cumulative, not delta, form)
with a provisional ``meta_info``; the last one carries the final ``meta_info``.
"""

from __future__ import annotations

from typing import Any

from stack.worker.engine import Req
from stack.worker.http.encoding import SSE_DONE, data_event
from stack.worker.http.relay import Completion


def generate_object(c: Completion) -> dict[str, Any]:
    """The non-streamed ``/generate`` body."""
    return {"text": c.text, "output_ids": c.ids, "meta_info": c.meta}


def partial_meta(req: Req, completion_tokens: int) -> dict[str, Any]:
    """``meta_info`` of a streamed frame before the request has finished."""
    return {
        "id": req.rid,
        "finish_reason": None,
        "prompt_tokens": req.L,
        "completion_tokens": completion_tokens,
    }


class GenerateStream:
    """``/generate`` with ``stream: true``: cumulative frames, then ``[DONE]``."""

    def __init__(self, req: Req) -> None:
        self.req = req
        self.text = ""
        self.ids: list[int] = []

    def on_token(self, token_id: int, text: str) -> list[bytes]:
        self.text += text
        self.ids.append(token_id)
        frame = {
            "text": self.text,
            "output_ids": list(self.ids),
            "meta_info": partial_meta(self.req, len(self.ids)),
        }
        return [data_event(frame)]

    def on_done(self, meta: dict[str, Any]) -> list[bytes]:
        return [data_event({"text": self.text, "output_ids": self.ids, "meta_info": meta})]

    def on_close(self) -> list[bytes]:
        return [SSE_DONE]
