"""Request features the router derives: tokens, block hashes, turn, est_hit.

:class:`FeatureExtractor` validates a body's prompt (chat messages, a completions or
``/generate`` prompt), tokenizes it (:mod:`stack.prefill_router.tokenizer`) and hashes its
blocks, reusing the hashes of a previous turn's prefix (:class:`HashMemo`).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from stack.kv_tier.hashing import ROOT, block_hashes
from stack.prefill_router.errors import ClientError, OverContext, over_context
from stack.prefill_router.tokenizer import Encoded, Tokenizer


@dataclass(slots=True)
class Features:
    tokens: np.ndarray
    prompt_tokens: int
    turn: int = 1
    est_hit: int = 0
    hashes: list[int] = field(default_factory=list)
    session_id: str | None = None
    cache_hit_tokens: int = 0  # tokens served from the tokenization cache


class HashMemo:
    """Block hashes of recently seen prompts, keyed by their segment-serial prefixes.

    An agent's follow-up shares all but its last few segments with the previous turn, so
    its chained block hashes up to that point are taken from the memo and only the new
    tail is hashed. Bounded (FIFO) in entries; one tuple of hashes per request is shared by
    that request's entries.
    """

    def __init__(self, block_size: int, capacity: int = 200_000) -> None:
        self.bs = block_size
        self.capacity = capacity
        self.d: dict[int, tuple[tuple[int, ...], int]] = {}
        self.reused_blocks = 0
        self.lock = threading.Lock()  # feature work runs on several threads

    def hashes(self, tokens: np.ndarray, sizes: list[int], serials: list[int]) -> list[int]:
        bs = self.bs
        d = self.d
        key = 0
        cum = 0
        keys = []
        best = None
        h64 = xxhash.xxh3_64_intdigest
        for n, ser in zip(sizes, serials, strict=True):
            if ser < 0:
                break
            key = h64(key.to_bytes(8, "little") + ser.to_bytes(8, "little"))
            cum += n
            keys.append((key, cum // bs))
            m = d.get(key)
            if m is not None:
                best = m
        if best is not None and best[1] > 0:
            out = list(best[0][: best[1]])
            start = best[1]
            self.reused_blocks += start
        else:
            out, start = [], 0
        out += block_hashes(tokens[start * bs :], bs, out[-1] if out else ROOT)
        if self.capacity > 0:
            # kept as a tuple of ints: the collector stops tracking it after one look, so a
            # full collection does not walk the memo's millions of hashes
            kept = tuple(out)
            with self.lock:
                for k, blocks in keys:
                    d[k] = (kept, blocks)
                over = len(d) - self.capacity
                if over > 0:
                    for k in list(itertools.islice(d, over)):
                        d.pop(k, None)
        return out


#: the chat roles OpenAI's API defines (and SGLang takes)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_messages(messages) -> list[dict]:
    if messages is None:
        raise ClientError("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise ClientError("'messages' must be an array", param="messages", code="invalid_type")
    if not messages:
        raise ClientError("'messages' must not be empty", param="messages", code="empty_array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ClientError(f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ClientError(
                f"messages[{i}].role must be a string", param=f"messages[{i}].role", code="invalid_type"
            )
        if role not in CHAT_ROLES:
            raise ClientError(
                f"messages[{i}].role {role[:40]!r} is not a role: one of {', '.join(sorted(CHAT_ROLES))}",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
        c = m.get("content")
        if c is not None and not isinstance(c, str | list):
            raise ClientError(
                f"messages[{i}].content must be a string or an array",
                param=f"messages[{i}].content",
                code="invalid_type",
            )
    return messages


def turn_of(messages: list[dict]) -> tuple[int, int]:
    """(turn, index of the last assistant message or -1): turn = 1 + prior assistant replies."""
    last = -1
    n = 0
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            n += 1
            last = i
    return n + 1, last


class FeatureExtractor:
    """Derives :class:`Features` from request bodies (chat, completions, generate)."""

    def __init__(
        self,
        model_path: str | Path | None,
        block_size: int,
        cache_tokens: int = 8_000_000,
        memo_entries: int = 200_000,
    ) -> None:
        self.block_size = block_size
        self.tok = Tokenizer(model_path, cache_tokens) if model_path else None
        self.memo = HashMemo(block_size, memo_entries) if memo_entries > 0 else None
        #: the model's context length, when the router sets it: a prompt at or over it is
        #: refused (400 ``context_length_exceeded``) as soon as that is certain, from the
        #: text's length (:meth:`Tokenizer.min_tokens`) or part-way through tokenizing it
        self.context_length: int | None = None

    def _encode(self, text: str, param: str, add_special_tokens: bool = False) -> Encoded:
        lim = self.context_length
        if lim is None:
            return self.tok.encode(text, add_special_tokens)
        try:
            n = self.tok.min_tokens(text)
            if n >= lim:
                raise OverContext(n)
            return self.tok.encode(text, add_special_tokens, limit=lim)
        except OverContext as e:
            raise over_context(e.tokens, lim, param, at_least=True) from None

    def _finish(
        self, tokens: np.ndarray, turn: int, est_hit: int, cached: int, enc: Encoded | None = None
    ) -> Features:
        if len(tokens) < self.block_size:
            hashes = []
        elif enc is not None and self.memo is not None:
            hashes = self.memo.hashes(tokens, enc.sizes, enc.serials)
        else:
            hashes = block_hashes(tokens, self.block_size)
        return Features(tokens, int(len(tokens)), turn, est_hit, hashes, None, cached)

    def chat(self, body: dict) -> Features:
        messages = check_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ClientError("'tools' must be an array", param="tools", code="invalid_type")
        turn, last = turn_of(messages)
        if self.tok is None:
            # no tokenizer: approximate 4 chars per token on the raw contents
            text = "".join(_content_text(m.get("content")) for m in messages)
            return self._approx(text, turn)
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise ClientError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        text = self.tok.render(messages, tools, True, extra)
        enc = self._encode(text, "messages")
        tokens, ends, cached = enc.tokens, enc.ends, enc.cached
        est_hit = 0
        content = messages[last].get("content") if last >= 0 else None
        if isinstance(content, str) and len(content) >= 8 and (cut := text.rfind(content)) >= 0:
            # fast path: the history ends with the last assistant reply, found in the render
            cut += len(content)
            prev = 0
            for end, n in ends:
                if prev >= cut:
                    break
                est_hit += n
                prev = end
        elif last >= 0:
            hist = self.tok.render(messages[: last + 1], tools, False, extra)
            if text.startswith(hist):
                cut = len(hist)
                for end, n in ends:
                    if end > cut:
                        break
                    est_hit += n
            else:  # a template that rewrites history (e.g. drops reasoning): estimate by chars
                est_hit = int(len(tokens) * len(hist) / max(1, len(text)))
        return self._finish(tokens, turn, est_hit, cached, enc)

    def prompt(self, prompt, param: str = "prompt") -> Features:
        """A completions / generate prompt: text, token ids, or a batch of either."""
        if isinstance(prompt, str):
            if not prompt:
                raise ClientError(f"'{param}' must not be empty", param=param, code="empty_prompt")
            if self.tok is None:
                return self._approx(prompt, 1)
            enc = self._encode(prompt, param, add_special_tokens=True)
            return self._finish(enc.tokens, 1, 0, enc.cached, enc)
        if isinstance(prompt, list):
            if not prompt:
                raise ClientError(f"'{param}' must not be empty", param=param, code="empty_prompt")
            if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
                if any(x < 0 for x in prompt):
                    raise ClientError("token ids must be >= 0", param=param, code="invalid_value")
                return self._finish(np.asarray(prompt, dtype="<u4"), 1, 0, 0)
            # a batch: route on the first element, count all
            feats = [self.prompt(p, param) for p in prompt]
            f0 = feats[0]
            f0.prompt_tokens = max(f.prompt_tokens for f in feats)
            return f0
        raise ClientError(
            f"'{param}' must be a string, an array of strings or of token ids",
            param=param,
            code="invalid_type",
        )

    def _approx(self, text: str, turn: int) -> Features:
        n = max(1, len(text) // 4)
        return Features(np.zeros(0, dtype="<u4"), n, turn, 0, [], None, 0)


def _content_text(c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""
