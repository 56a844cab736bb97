"""The simulator's state of one prefill instance, of a request on it, and of a link.

:class:`Instance`: its waiting queue, the unfinished chunked request, the forward in
flight, its prefix cache and the figures the router's view reads (stack/sim/view.py).
:class:`Job`: one request routed to an instance, from its arrival to its answer.
:class:`Link`: a NIC, one FIFO of global-tier transfers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stack.kv_tier.prefix_cache import LockingPrefixCache, PrefixCache

if TYPE_CHECKING:
    from stack.core.types import DecisionKind, Request
    from stack.sim.clients import Attempt
    from stack.sim.load import SessionStart
    from stack.traces.model import TraceRequest


def window_overlap(start: float, end: float, ws: float, we: float) -> float:
    """Seconds of the busy interval ``[start, end)`` inside the measurement window
    ``[ws, we)``: what GPU and link utilization over the window count."""
    if start < we and end > ws:
        return (end if end < we else we) - (start if start > ws else ws)
    return 0.0


class Link:
    """A NIC: one FIFO of transfers (global-tier fetches and, with ``global_write=link``,
    writes) at the link's bandwidth."""

    __slots__ = ("bw", "free_at", "busy_s", "tokens", "write_tokens", "ws", "we", "busy_w")

    def __init__(self, bw: float) -> None:
        self.bw = bw
        self.free_at = 0.0
        self.busy_s = 0.0
        self.tokens = 0
        self.write_tokens = 0
        self.ws = 0.0  # measurement window, for busy_w
        self.we = math.inf
        self.busy_w = 0.0

    def fetch(self, now: float, tokens: int) -> float:
        """Queue a transfer of ``tokens``; returns when it is done."""
        start = self.free_at if self.free_at > now else now
        dur = tokens / self.bw
        end = start + dur
        self.free_at = end
        self.busy_s += dur
        self.tokens += tokens
        self.busy_w += window_overlap(start, end, self.ws, self.we)
        return end

    def write(self, now: float, tokens: int) -> float:
        self.write_tokens += tokens
        return self.fetch(now, tokens)


class Job:
    """One request on its instance: its prompt (``L`` tokens, ``path`` its prefix keys), the
    tokens still to prefill (``rem``, from position ``pos``), what its local and global
    tiers gave (``local``, ``glob``), when its fetched KV is in (``ready_at``), its
    estimated prefill seconds (``est``) and, colocated, its decode (``out``, ``t_first``,
    ``fin``) and whether its KV room is reserved (``admitted``)."""

    __slots__ = (
        "tr", "copy", "path", "L", "rem", "pos", "arrival", "ready_at", "local", "glob",
        "est", "kind", "feat", "measured", "req", "matched", "held", "fetched", "fwait",
        "qwait", "out", "t_first", "fin", "admitted", "prio", "att",
    )  # fmt: skip

    def __init__(
        self,
        tr: TraceRequest,
        copy: SessionStart,
        path: tuple,
        req: Request,
        kind: DecisionKind,
        feat: Any,
        arrival: float,
        qwait: float,
        measured: bool,
        att: Attempt | None,
        matched: bool,
        local: int,
        glob: int,
        ready_at: float,
        fwait: float,
        rem: int,
        est: float,
    ) -> None:
        """Trace request ``tr`` of the session copy ``copy`` (``path``: its prefix keys, ``req``:
        what the policy saw) placed as ``kind`` (``feat``: what the policy learns from once it
        is done; ``att``: its client's attempt, or None), first arrived at ``arrival`` and
        held ``qwait`` seconds at the router: ``local`` prompt tokens from the instance's
        cache (``matched``: matched there already), ``glob`` to fetch from the global tier
        (in by ``ready_at``, ``fwait`` seconds from now), ``rem`` to compute in an estimated
        ``est`` seconds. Its decode and priority class start unset."""
        self.tr = tr
        self.copy = copy
        self.path = path
        L = tr.input_len
        self.L = L
        self.req = req
        self.kind = kind
        self.feat = feat
        self.arrival = arrival
        self.qwait = qwait
        self.measured = measured
        self.att = att
        self.matched = matched
        self.held: Any = None
        self.local = local
        self.glob = glob
        self.fetched = glob
        self.ready_at = ready_at
        self.fwait = fwait
        self.rem = rem
        self.pos = L - rem
        self.est = est
        self.out = tr.output_len
        self.admitted = False
        self.t_first = 0.0
        self.fin = 0
        self.prio = 0


def enqueue_by_class(waiting: list[Job], j: Job, cls: int) -> None:
    """Queue ``j`` of priority class ``cls`` (0 first;
    :func:`stack.dispatch.sglang_priority.priority_class`) in ``waiting``, kept in
    (class, time queued) order: after every job of its class or a more urgent one. This is
    SGLang 0.5.23's waiting-queue order under ``--enable-priority-scheduling`` (its sort by
    priority then queue-entry time), kept by insertion instead of a sort per batch; the
    instance never preempts (``--disable-priority-preemption``): the chunked job of the
    last forward goes on first whatever its class."""
    j.prio = cls
    i = len(waiting)
    while i and waiting[i - 1].prio > cls:
        i -= 1
    if i == len(waiting):
        waiting.append(j)
    else:
        waiting.insert(i, j)


class Instance:
    """One prefill instance: ``waiting`` jobs (FCFS, or by priority class then arrival:
    :func:`enqueue_by_class`), the ``chunked`` one to continue, the
    ``batch`` of the forward in flight (``busy``), the finished prefills it has yet to hand
    over (``handing``), its prefix cache, the figures the router's
    view reads (``q_tokens``, ``q_seconds``, ``n_jobs``, ``a_tokens``, ``decode_*``) and its
    busy time and queue-length integral (``area``, per measurement window)."""

    __slots__ = (
        "idx", "cache", "waiting", "chunked", "busy", "batch", "q_tokens", "q_seconds",
        "n_jobs", "a_tokens", "link", "last_t", "area", "wake_at", "busy_s", "computed", "busy_w",
        "decode_running", "decode_tokens", "decode_step_s", "handing",
    )  # fmt: skip

    def __init__(self, idx: int, cap_blocks: int, link: Link, locking: bool = False) -> None:
        self.idx = idx
        self.cache = LockingPrefixCache(cap_blocks) if locking else PrefixCache(cap_blocks)
        self.waiting: list[Job] = []
        self.chunked: Job | None = None
        self.busy = False
        self.batch: list[tuple[Job, int]] = []
        self.q_tokens = 0
        self.q_seconds = 0.0
        self.n_jobs = 0
        self.a_tokens = 0
        self.link = link
        self.last_t = 0.0
        self.area: dict[int, float] = {}
        self.wake_at = math.inf
        self.busy_s = 0.0
        self.busy_w = 0.0  # busy seconds within the measurement window
        self.computed = 0
        # decode load in the router's view: none under PD disaggregation
        self.decode_running = 0
        self.decode_tokens = 0
        self.decode_step_s = 0.0
        #: prefills done whose hand-over waits for the end of the pass (``between_forwards``)
        self.handing: list[Job] = []


def accrue(inst: Instance, t: float, window_s: float) -> None:
    """Integrate ``inst``'s queue length (``n_jobs``) over time up to ``t`` into its windows
    of ``window_s`` seconds (``area``: what the imbalance figures read)."""
    lt = inst.last_t
    n = inst.n_jobs
    if n and t > lt:
        W = window_s
        w0 = int(lt // W)
        w1 = int(t // W)
        area = inst.area
        if w0 == w1:
            area[w0] = area.get(w0, 0.0) + n * (t - lt)
        else:
            area[w0] = area.get(w0, 0.0) + n * ((w0 + 1) * W - lt)
            for w in range(w0 + 1, w1):
                area[w] = area.get(w, 0.0) + n * W
            area[w1] = area.get(w1, 0.0) + n * (t - w1 * W)
    inst.last_t = t
