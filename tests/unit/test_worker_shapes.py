"""The emulator's answer builders without a server: OpenAI and SGLang objects and stream
frames built from a fixed sequence of engine items (``Worker.execute``'s contract)."""

from __future__ import annotations

import asyncio
import json

from stack.worker.engine import GenParams, Req
from stack.worker.http.relay import Completion, collect, frames
from stack.worker.http.shapes import openai
from stack.worker.http.shapes.sglang import GenerateStream, generate_object

META = {
    "id": "r1",
    "finish_reason": {"type": "stop", "matched": "."},
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "cached_tokens": 1,
}


async def _items():
    yield {"token": 7, "text": " a"}
    yield {"token": 8, "text": " b"}
    yield {"done": META}


async def _no_tokens():
    yield {"done": {**META, "completion_tokens": 0, "finish_reason": {"type": "abort"}}}


def _decoded(shape, items) -> list:
    async def run():
        return [f async for f in frames(items, shape)]

    out = []
    for f in asyncio.run(run()):
        assert f.startswith(b"data: ") and f.endswith(b"\n\n")
        d = f[6:-2].decode()
        out.append(d if d == "[DONE]" else json.loads(d))
    return out


def test_collect_and_objects():
    c = asyncio.run(collect(_items()))
    assert c == Completion(" a b", [7, 8], META)
    assert generate_object(c) == {"text": " a b", "output_ids": [7, 8], "meta_info": META}
    h = openai.Head("chatcmpl-r1", 1, "m")
    chat = openai.completion_object(openai.CHAT, h, c)
    # SGLang: no meta_info on an OpenAI answer unless a non-streamed chat body asks for it
    assert chat["object"] == "chat.completion" and "meta_info" not in chat and "sglext" not in chat
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " a b"},
            "logprobs": None,
            "finish_reason": "stop",
            "matched_stop": ".",
        }
    ]
    assert chat["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    text = openai.completion_object(openai.TEXT, h, c)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == " a b"
    assert openai.head(openai.TEXT, "r1", "m").id == "cmpl-r1"


def test_chat_stream_frames():
    h = openai.Head("chatcmpl-r1", 1, "m")
    out = _decoded(openai.CompletionStream(openai.CHAT, h, include_usage=True), _items())
    assert [o["choices"][0]["delta"] for o in out[:2]] == [
        {"role": "assistant", "content": " a"},
        {"content": " b"},
    ]
    assert out[2]["choices"][0]["finish_reason"] == "stop" and "meta_info" not in out[2]
    assert out[3]["choices"] == [] and out[3]["usage"]["total_tokens"] == 5
    assert out[4] == "[DONE]"
    assert {o["object"] for o in out[:4]} == {"chat.completion.chunk"}
    # no token before the end: the final chunk still opens the assistant message
    out = _decoded(openai.CompletionStream(openai.CHAT, h, include_usage=False), _no_tokens())
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out[0]["choices"][0]["finish_reason"] == "abort" and out[1] == "[DONE]"


def test_generate_stream_is_cumulative():
    req = Req(rid="r1", tokens=[1, 2, 3], params=GenParams())
    out = _decoded(GenerateStream(req), _items())
    assert [o["text"] for o in out[:3]] == [" a", " a b", " a b"]
    assert out[1]["output_ids"] == [7, 8] and out[1]["meta_info"]["finish_reason"] is None
    assert out[2]["meta_info"] == META and out[3] == "[DONE]"


def test_stream_interval_batches_writes_not_frames():
    """``stream_interval`` 2: the first token's frame alone, then two tokens' frames per write;
    the bytes on the wire are the same as one frame per write."""
    from stack.worker.http.shapes import openai

    async def items():
        for i in range(5):
            yield {"token": i, "text": f" t{i}"}
        yield {"done": META}

    async def run(interval: int) -> list[bytes]:
        h = openai.Head("chatcmpl-r1", 1, "m")
        return [f async for f in frames(items(), openai.CompletionStream(openai.CHAT, h, True), interval)]

    one, two = asyncio.run(run(1)), asyncio.run(run(2))
    assert b"".join(one) == b"".join(two)
    assert [w.count(b"data: ") for w in two] == [1, 2, 2, 3]  # tokens 1 | 2 | 2 | done, usage, [DONE]


def test_openai_extras_only_where_sglang_sends_them():
    """SGLang 0.5.23: ``meta_info`` on the choice of a non-streamed chat answer that asks
    ``return_meta_info`` (refused on a stream, ignored on /v1/completions);
    ``sglext.cached_tokens_details`` when asked, on the object or in a chunk of its own."""
    import pytest

    meta = {**META, "cached_tokens_local": 64, "cached_tokens_global": 128}
    c = Completion(" a b", [7, 8], meta)
    h = openai.Head("chatcmpl-r1", 1, "m")
    asked = openai.extras(openai.CHAT, {"return_meta_info": True}, None)
    chat = openai.completion_object(openai.CHAT, h, c, asked)
    assert chat["choices"][0]["meta_info"] == meta and "meta_info" not in chat
    with pytest.raises(ValueError, match="stream"):
        openai.extras(openai.CHAT, {"return_meta_info": True, "stream": True}, None)
    text_ex = openai.extras(openai.TEXT, {"return_meta_info": True}, None)
    assert "meta_info" not in openai.completion_object(openai.TEXT, h, c, text_ex)["choices"][0]
    det = openai.extras(openai.CHAT, {"return_cached_tokens_details": True}, "mooncake")
    obj = openai.completion_object(openai.CHAT, h, c, det)
    assert obj["sglext"] == {
        "cached_tokens_details": {"device": 64, "host": 0, "storage": 128, "storage_backend": "mooncake"}
    }
    out = _decoded(openai.CompletionStream(openai.CHAT, h, include_usage=True, ex=det), _items())
    assert out[3]["choices"] == [] and out[3]["sglext"]["cached_tokens_details"]["device"] == 1
    assert "usage" in out[4] and out[5] == "[DONE]"
