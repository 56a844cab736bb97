"""The emulated KV payload: deterministic bytes per page, so every hop can be verified.

Page ``k`` of a request (chained hash ``h_k``) holds ``page_size * bytes_per_token`` bytes: the
8-byte little-endian hash repeated. The partial last page's bytes come from a hash of its
tokens. Anyone holding the token ids can recompute the exact bytes a prefill produced.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash


def page_bytes(h: int, n_bytes: int) -> bytes:
    unit = struct.pack("<q", h)
    return (unit * (n_bytes // 8 + 1))[:n_bytes]


def tail_bytes(tokens: Sequence[int], n_bytes: int) -> bytes:
    if n_bytes <= 0:
        return b""
    seed = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *[t & 0xFFFFFFFF for t in tokens]))
    unit = struct.pack("<Q", seed)
    return (unit * (n_bytes // 8 + 1))[:n_bytes]


def request_kv(tokens: Sequence[int], hashes: Sequence[int], page_size: int, bytes_per_token: int) -> bytes:
    """The whole request's KV: every full page, then the partial tail."""
    pb = page_size * bytes_per_token
    parts = [page_bytes(h, pb) for h in hashes]
    tail = tokens[len(hashes) * page_size :]
    parts.append(tail_bytes(tail, len(tail) * bytes_per_token))
    return b"".join(parts)


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def store_key(prefix: str, h: int) -> str:
    """Global-tier key of one page: ``prefix`` + the router's block hash as 16 hex digits (the
    router's ``global_index.default_key`` when the prefix is empty). Content-addressed, so
    ``put`` of an existing key is harmless."""
    return f"{prefix}{h & 0xFFFFFFFFFFFFFFFF:016x}"
