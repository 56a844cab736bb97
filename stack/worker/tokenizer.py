"""Tokenization for the emulated worker.

By default a deterministic, dependency-free tokenizer: words, single punctuation characters
and whitespace runs each become one token whose id is a hash of the piece. It is
prefix-stable (a text's prefix tokenizes to a prefix of its tokens, up to the last piece),
which is what prefix caching needs. With ``tokenizer_path`` (a directory holding an HF
``tokenizer.json`` and optionally ``tokenizer_config.json`` with a ``chat_template``) the real
tokenizer and template are used, so the emulator's tokens equal the router's.

Clients that already hold token ids send ``input_ids`` (``/generate``) or a list of ints as
``prompt`` (``/v1/completions``) and bypass tokenization entirely.
"""

from __future__ import annotations

import re
from pathlib import Path

import xxhash

_PIECE = re.compile(r"\w+|[^\w\s]|\s+")
VOCAB = 151_000
_SPECIAL = {"<|im_start|>": 151_644, "<|im_end|>": 151_645, "<|endoftext|>": 151_643}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in _SPECIAL) + ")")


class SimpleTokenizer:
    name = "emulator-hash"
    template_src = None  # no jinja template (agent APIs: SGLang's "string" content format)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            sid = _SPECIAL.get(part)
            if sid is not None:
                out.append(sid)
                continue
            out.extend(xxhash.xxh32_intdigest(p.encode()) % VOCAB for p in _PIECE.findall(part))
        return out

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_chat(self, body: dict) -> list[int]:
        return self.encode(self.apply_chat_template(body["messages"]))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(c.get("text", "") for c in content if isinstance(c, dict))
            parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class HFTokenizer:
    """The model's HF tokenizer and chat template, through the router's own ``Tokenizer``
    (``stack.prefill_router.tokenizer``), so the emulator's token ids equal the router's."""

    def __init__(self, path: str | Path):
        from stack.prefill_router.tokenizer import Tokenizer

        self._tok = Tokenizer(path, cache_tokens=2_000_000)
        self.name = str(path)
        self.template_src = self._tok.template_src

    def encode_prompt(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)[0].tolist()

    def encode_chat(self, body: dict) -> list[int]:
        extra = body.get("chat_template_kwargs")
        text = self._tok.render(
            body["messages"], body.get("tools"), True, extra if isinstance(extra, dict) else None
        )
        return self._tok.encode(text)[0].tolist()  # numpy -> ints in C (50x the listcomp)


def load_tokenizer(path: str | None):
    return HFTokenizer(path) if path else SimpleTokenizer()


# Deterministic output text: a fixed word list, picked by a stream seeded from the prompt.
_WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have "
    "not but all were when we there can more if one will so about out up their what time "
    "model cache token prefill decode router request session agent tool call result file "
    "code test build run value output input data page block hash store"
).split()


def output_token(seed: int, i: int) -> tuple[int, str]:
    """The i-th output token (id, text) of a request whose prompt seeds ``seed``."""
    h = xxhash.xxh3_64_intdigest(i.to_bytes(4, "little"), seed & 0xFFFFFFFFFFFFFFFF)
    w = _WORDS[h % len(_WORDS)]
    piece = ("." if h % 11 == 0 else "") + " " + w
    return (h % VOCAB), piece
