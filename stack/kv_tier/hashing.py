"""Chained block hashes of token ids, one per full page.

``h_k = xxh3_64(h_{k-1} (8 bytes, little endian) || token ids of block k (uint32 LE))``
with ``h_{-1} = 0``. Only full pages are hashed (engines only report full pages). The
router keys its prefix index on these hashes; engine hashes from KV events are mapped to
them through the events' token ids (engines' own hash schemes changed across versions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

ROOT = 0
_h = xxhash.xxh3_64_intdigest


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian uint32 array (negative ids are rejected)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4"):
        return tokens
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError("token ids must be >= 0")
    return arr.astype("<u4")


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = ROOT, start_block: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (from block ``start_block`` on).

    ``parent`` is the hash of the block before ``start_block`` (``ROOT`` for the first).
    """
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    arr = np.ascontiguousarray(as_tokens(tokens))
    mv = memoryview(arr).cast("B")  # no copy
    step = block_size * 4
    n = len(mv) // step
    out: list[int] = []
    prev = parent
    for k in range(start_block, n):
        prev = _h(prev.to_bytes(8, "little") + mv[k * step : (k + 1) * step])
        out.append(prev)
    return out


def chain_one(parent: int, block_tokens: Sequence[int] | np.ndarray) -> int:
    """The hash of one block given its parent's hash."""
    return _h(parent.to_bytes(8, "little") + as_tokens(block_tokens).tobytes())
