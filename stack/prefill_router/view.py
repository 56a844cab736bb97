"""The live router's :class:`ClusterView`: the pool's figures as the policies see them.

A pure function (no I/O, no clock: ``now`` is an argument) so that a test can hand it
the same figures as the simulator's view builder and compare the two views.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from stack.core.cost_model import DecodeCost
from stack.core.types import ClusterView, InstanceState, usable_hit
from stack.pool import LOAD_FRESH_S, Worker


def build_view(
    now: float,
    workers: Iterable[Worker],
    local_hit_blocks: Mapping[int, int],
    global_hit_blocks: int,
    *,
    prompt_tokens: int,
    block_size: int,
    fetch_tokens_per_s: float,
    sec_per_token: float,
    fresh_s: float = LOAD_FRESH_S,
    decode: DecodeCost | None = None,
    link_now: float | None = None,
) -> ClusterView:
    """One :class:`InstanceState` per candidate prefill worker, in ``workers`` order.

    Per worker: queued tokens and seconds, and running requests, each the router's own
    accounting (plus the other replicas') reconciled with a poll younger than ``fresh_s``
    (unknown waiting requests charged at ``sec_per_token``); ``local_hit_blocks`` (by
    worker id, absent = 0) and ``global_hit_blocks`` are in blocks, the view in tokens,
    capped by :func:`usable_hit` (as the simulator's view is).
    ``decode_running``, ``decode_tokens`` and ``decode_step_s`` stay 0 under disaggregation
    (a prefill worker runs no decode). With ``decode`` (PD colocation: the pool's workers
    decode what they prefill) they are the requests the worker decodes (the router's own
    accounting: prefill done, answer not ended), their contexts, and the seconds their
    decode adds to each forward (``decode.mixed_extra``, as the simulator's colocated mode
    prices it); ``running`` counts them too (:meth:`Worker.view_load`), as the simulator's
    colocated view does.
    With ``link_now`` (the pool's clock), each state's ``fetch_backlog_s`` is the worker's
    booked global-tier fetches still queued on its link then (:meth:`Worker.link_backlog`,
    the router's own accounting, as the simulator's view reads its link's FIFO); without, 0.
    """
    insts = []
    append = insts.append
    for w in workers:
        qt, qs, running = w.view_load(fresh_s, now, sec_per_token)
        blocks = local_hit_blocks.get(w.wid, 0) if local_hit_blocks else 0
        hit = usable_hit(blocks * block_size, prompt_tokens) if blocks else 0
        s = InstanceState(w.wid, qt, qs, running, hit, active_tokens=w.active_tokens)
        if link_now is not None:
            s.fetch_backlog_s = w.link_backlog(link_now)
        if decode is not None and w.decoding:
            b = len(w.decoding)
            c = sum(w.decoding.values())
            s.decode_running = b
            s.decode_tokens = c
            s.decode_step_s = decode.mixed_extra(b, c, sec_per_token)
        append(s)
    glob = usable_hit(global_hit_blocks * block_size, prompt_tokens)
    return ClusterView(now, insts, glob, fetch_tokens_per_s, block_size)
