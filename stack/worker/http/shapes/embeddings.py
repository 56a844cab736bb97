"""OpenAI's embeddings answer, as SGLang 0.5.23 serves ``/v1/embeddings``.

The emulator has no model: a prompt's vector is a deterministic function of its token ids
(:data:`DIM` numbers from a hash of each id and position, summed and L2-normalised), so the
same prompt always embeds the same and different prompts differ.
"""

from __future__ import annotations

import math
from typing import Any

import xxhash

#: the emulated embedding's dimension
DIM = 16


def vector(tokens: list[int], dim: int = DIM) -> list[float]:
    """The unit vector of ``tokens`` (``[1, 0, ...]`` for no tokens)."""
    v = [0.0] * dim
    for pos, t in enumerate(tokens):
        h = xxhash.xxh64_intdigest(t.to_bytes(8, "little", signed=True) + pos.to_bytes(8, "little"))
        for j in range(dim):
            v[j] += ((h >> (j * 4)) & 0xF) / 7.5 - 1.0
    n = math.sqrt(sum(x * x for x in v))
    if n == 0.0:
        return [1.0] + [0.0] * (dim - 1)
    return [x / n for x in v]


def embedding_list(prompts: list[list[int]], model: str) -> dict[str, Any]:
    """``{"object": "list", "data": [{"object": "embedding", "embedding", "index"}], "model",
    "usage"}`` for the prompts' token ids, in order."""
    n = sum(len(p) for p in prompts)
    return {
        "object": "list",
        "data": [{"object": "embedding", "embedding": vector(p), "index": i} for i, p in enumerate(prompts)],
        "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
