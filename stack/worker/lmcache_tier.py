"""The emulated worker's global tier through LMCache (``launch.kv_tier: lmcache``).

The engine's global tier is a page-keyed store (``batch_is_exist`` / ``get_many`` /
``put_many`` over one key per page, as ``stack.kv_tier.mooncake_store``). LMCache is keyed by
token prefixes in 256-token chunks, so this adapter gives the engine page keys it can map back
to the request's tokens (:meth:`LMCacheStore.keys_for`, called where the engine makes a
request's keys) and turns each call into a call on the worker's LMCache engine sidecar
(:mod:`stack.kv_tier.lmcache_engine_sidecar`, LMCache's own engine with the Mooncake store as
its remote):

- ``batch_is_exist(keys)`` -> ``lookup`` of the prompt up to the last key's page: pages
  inside the hit exist;
- ``get_many(keys)`` -> ``retrieve`` of that prefix (local CPU, else the Mooncake store), cut
  into pages (a page past the hit is ``None``);
- ``put_many(keys, values)`` -> ``store`` of the prompt's pages' bytes (whole chunks kept).

Blocking calls (the engine runs them on its store threads, bounded by ``store_timeout_s``).
The key -> (tokens, page) map is bounded (``max_keys``, oldest first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from stack.kv_tier.lmcache_client import LMCacheClient

__all__ = ["LMCacheStore"]


class LMCacheStore:
    def __init__(self, url: str, page_size: int, kv_bytes_per_token: int, max_keys: int = 200_000) -> None:
        self.client = LMCacheClient(url)
        self.ps = page_size
        self.bpt = kv_bytes_per_token
        self.max_keys = max_keys
        self._where: OrderedDict[str, tuple[Sequence[int], int]] = OrderedDict()
        self._lock = threading.Lock()

    def keys_for(self, tokens: Sequence[int], keys: list[str]) -> list[str]:
        """Remember which request tokens and page each of ``keys`` (one per full page) is."""
        with self._lock:
            for i, k in enumerate(keys):
                self._where[k] = (tokens, i)
                self._where.move_to_end(k)
            while len(self._where) > self.max_keys:
                self._where.popitem(last=False)
        return keys

    def _span(self, keys: Sequence[str]) -> tuple[Sequence[int], int, int]:
        """(tokens, first page, end page) of a run of consecutive page keys."""
        with self._lock:
            first = self._where.get(keys[0])
            last = self._where.get(keys[-1])
        if first is None or last is None or first[0] is not last[0]:
            raise KeyError("page keys not made by keys_for (or forgotten)")
        return first[0], first[1], last[1] + 1

    def batch_is_exist(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        tokens, p0, p1 = self._span(keys)
        hit = self.client.lookup(list(tokens[: p1 * self.ps]))
        return [(p0 + j + 1) * self.ps <= hit for j in range(len(keys))]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        tokens, p0, p1 = self._span(keys)
        got = self.client.retrieve(list(tokens[: p1 * self.ps]))
        pb = self.ps * self.bpt
        out: list[bytes | None] = []
        for j in range(len(keys)):
            lo, hi = (p0 + j) * pb, (p0 + j + 1) * pb
            out.append(got.kv[lo:hi] if (p0 + j + 1) * self.ps <= got.hit_tokens else None)
        return out

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> int:
        """Store the pages (from the prompt's first); returns the pages LMCache kept."""
        if not keys:
            return 0
        tokens, p0, p1 = self._span(keys)
        if p0 != 0:
            raise ValueError("LMCache stores a prompt from its first token")
        stored = self.client.store(list(tokens[: p1 * self.ps]), b"".join(values))
        return stored // self.ps

    def close(self) -> None:
        with self._lock:
            self._where.clear()
