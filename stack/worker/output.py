"""What a request generates and when: its deterministic output tokens (a function of the
prompt, the parameters and ``max_natural_tokens``) and the decode cadence they stream at."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from stack.worker.request import Req
from stack.worker.tokenizer import output_token
from stack.worker.tool_calls import pieces

EOS_TOKEN_ID = 151_645


def plan_output(req: Req, max_natural_tokens: int) -> tuple[list[tuple[int, str]], dict]:
    """The deterministic output (token id, text piece) list and its finish_reason (a forced
    tool call: its arguments, cut at ``max_new_tokens``)."""
    p = req.params
    seed = req.hashes[-1] if req.hashes else hash(tuple(req.tokens)) & 0xFFFFFFFF
    seed ^= len(req.tokens)
    if p.tool_call is not None:
        call = pieces(p.tool_call.arguments)
        n = len(call) if p.max_new_tokens is None else min(p.max_new_tokens, len(call))
        out = [(output_token(seed, i)[0], call[i]) for i in range(n)]
        if n < len(call):
            return out, {"type": "length", "length": n}
        return out, {"type": "stop", "matched": EOS_TOKEN_ID}
    natural = 8 + (seed & 0xFFFF) % max(1, max_natural_tokens - 7)
    if p.ignore_eos:
        n = p.max_new_tokens if p.max_new_tokens is not None else natural
    else:
        n = natural if p.max_new_tokens is None else min(p.max_new_tokens, natural)
    out: list[tuple[int, str]] = []
    text = ""
    for i in range(n):
        tid, piece = output_token(seed, i)
        new_text = text + piece
        for st in p.stop:
            if st and st in new_text:
                keep = new_text[: new_text.index(st)][len(text) :]
                out.append((tid, keep))
                return out, {"type": "stop", "matched": st}
        out.append((tid, piece))
        text = new_text
    if p.max_new_tokens is not None and n >= p.max_new_tokens:
        return out, {"type": "length", "length": n}
    return out, {"type": "stop", "matched": EOS_TOKEN_ID}


async def pace_tokens(n: int, per_token_s: float) -> AsyncIterator[int]:
    """Yield token indices ``per_token_s`` wall seconds apart, on deadlines (token i is due
    ``i * per_token_s`` after the first), so the host work of streaming does not add to it. The
    answer ends with its last token (no wait after it), as SGLang's does. Behind by more than a
    token (the process stalled), the pace resumes from now, as an engine's decode steps do after
    a stall: the missed tokens are not burst out at once (a client timing the stream read a burst
    as a TPOT many times too short)."""
    t0 = time.monotonic()
    for i in range(n):
        yield i
        if i == n - 1:
            return
        now = time.monotonic()
        wait = t0 + (i + 1) * per_token_s - now
        if wait >= 0.002:
            await asyncio.sleep(wait)
        elif wait < -per_token_s:
            t0 = now - (i + 1) * per_token_s
