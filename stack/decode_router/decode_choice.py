"""Decode-worker choice: the least loaded by running requests, then KV usage."""

from __future__ import annotations

import time
from collections.abc import Iterable

from stack.pool import LOAD_FRESH_S, Worker


def decode_score(w: Worker, now: float, fresh_s: float = LOAD_FRESH_S) -> tuple[float, float, int]:
    """Lower is better: (running requests, KV token usage, id for determinism)."""
    running = w.view_running(fresh_s, now)
    usage = w.polled_token_usage if now - w.polled_at <= fresh_s else 0.0
    return (running + usage * 8.0, usage, w.wid)


def pick_decode(workers: Iterable[Worker], exclude: set[int] | None = None) -> Worker | None:
    """The healthy decode worker (not in ``exclude`` nor draining) with the lowest
    :func:`decode_score`."""
    now = time.monotonic()
    best = None
    best_s = None
    for w in workers:
        if not w.healthy or w.draining_until is not None or (exclude and w.wid in exclude):
            continue
        s = decode_score(w, now)
        if best_s is None or s < best_s:
            best, best_s = w, s
    return best
