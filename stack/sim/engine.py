"""Discrete-event simulator of a PD-disaggregated prefill cluster.

Per instance, scheduling follows SGLang's prefill scheduler: a FCFS waiting queue; each
forward pass takes the unfinished chunked request first, then waiting requests in order,
up to a token budget (``--chunked-prefill-size``); a request larger than what is left of
the budget is chunked and continues in the next forward. A forward costs
``c_fwd + sum(c_linear*n + c_attn*n*(end - n/2))`` over its chunks. A request whose
global-tier fetch is still in flight is skipped until its KV has arrived.

Tiers: a local HBM prefix cache per instance (LRU, capacity in tokens) and an optional
global tier (LRU with a capacity, or unbounded) whose fetches go over a link shared by the
instances of a server (or one link per GPU), FIFO at the link's bandwidth. KV is written
to both tiers when a request's prefill completes.

Router view: exact and causal: queued work, running requests and the cache contents at
the moment of the decision (what KV events would have told a live router); see
stack/sim/view.py.

Decode is not simulated here (PD disaggregation: a separate pool): a request is answered
``output_len * tpot`` after its prefill, and the agent's next turn arrives ``think``
seconds later. PD colocation (prefill chunks and decodes in the same forwards, TPOT per
request) is :class:`stack.sim.colocated.ColocatedSimulator`, a subclass of this one
(``SimConfig.mode``; :func:`stack.sim.colocated.make_simulator` picks the class).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stack.core.cost_model import CostModel, Hardware, load_hardware
from stack.core.types import SLO, ClusterView, DecisionKind, InstanceState, Request
from stack.dispatch import Entry, Rejected, estimate_size, make_dispatcher
from stack.kv_tier.prefix_cache import LockingPrefixCache, PrefixCache
from stack.policies import Policy, PolicyContext, make_policy
from stack.sim.load import LoadSpec, SessionStart, plan, resolve_load_mode
from stack.sim.view import build_view
from stack.traces.model import Trace, TraceRequest

ARRIVE, FORWARD_DONE, WAKE, WRITTEN, DISPATCH = 0, 1, 2, 3, 4


@dataclass(slots=True)
class GlobalTierSpec:
    """``mode``: none | full | sized (capacity in tokens)."""

    mode: str = "full"
    capacity_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | None, kv_bytes_per_token: int = 98304) -> GlobalTierSpec:
        """``none``, ``full``, or a size: tokens (``2M``, ``500k``) or bytes (``256GB``)."""
        if text is None or text == "full":
            return cls("full")
        if text == "none":
            return cls("none")
        t = text.strip().lower()
        units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
        try:
            if t.endswith(("gb", "tb", "mb", "kb", "gib", "tib", "mib")):
                num = t.rstrip("ib").rstrip("b")
                mult = units[num[-1]]
                if "i" in t:
                    mult = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[num[-1]]
                cap = float(num[:-1]) * mult / kv_bytes_per_token
            elif t[-1] in units:
                cap = float(t[:-1]) * units[t[-1]]
            else:
                cap = float(t)
        except (ValueError, KeyError, IndexError):
            raise ValueError(
                f"invalid global tier {text!r}: use none, full, a token count (2M) or a size (256GB)"
            ) from None
        if cap < 0 or math.isnan(cap):
            raise ValueError("global tier capacity must be >= 0")
        return cls("sized", int(cap))


@dataclass(slots=True)
class SimConfig:
    instances: int = 32
    hardware: Hardware = field(default_factory=lambda: load_hardware("h20"))
    global_tier: GlobalTierSpec = field(default_factory=GlobalTierSpec)
    link: str = "per-gpu"  # per-gpu | shared (one NIC per server)
    slo: SLO = field(default_factory=SLO)
    hbm_tokens: int | None = None  # override the calibration's HBM KV room
    chunk_tokens: int | None = None
    window_s: float = 30.0
    policy_params: dict = field(default_factory=dict)
    # when an instance matches its local prefix cache: at the request's arrival (the hit the
    # router saw; older behaviour), or when the request first enters a prefill batch, as
    # SGLang does (matched blocks are then locked until the request completes)
    match_at: str = "arrival"  # arrival | schedule
    # a completed prefill's KV reaches the global tier: at once, or after its write over the
    # instance's link (same FIFO as fetches; visible to lookups when the write is done)
    global_write: str = "instant"  # instant | link
    # the dispatcher between the policy and the instances (stack/dispatch): ``immediate``
    # routes every request at its arrival (no queue at the router); the others hold requests
    # until an instance is ready and release them in their order
    dispatch: str = "immediate"
    dispatch_params: dict = field(default_factory=dict)
    # ``pd``: prefill instances only (decode in another pool); ``colocated``: each instance
    # also decodes its requests in the same forwards (stack/sim/colocated.py)
    mode: str = "pd"
    # colocated: advance running decodes over intervals of equal batch composition
    # (``aggregate``) or one event per decode forward (``step``, the reference)
    decode_steps: str = "aggregate"

    def dispatch_label(self) -> str:
        """The order and its parameters as given, e.g. ``deadline-defer:age_k=2``."""
        return self.dispatch + "".join(f":{k}={v:g}" for k, v in sorted(self.dispatch_params.items()))

    def validate(self) -> None:
        if self.instances <= 0:
            raise ValueError("instances must be > 0")
        if self.hbm_tokens is not None and self.hbm_tokens < 0:
            raise ValueError("HBM capacity must be >= 0")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ValueError("chunk size must be > 0")
        if self.link not in ("per-gpu", "shared"):
            raise ValueError("link must be per-gpu or shared")
        if self.slo.b < 0 or self.slo.a < 0:
            raise ValueError("SLO terms must be >= 0")
        if self.window_s <= 0:
            raise ValueError("window must be > 0")
        if self.match_at not in ("arrival", "schedule"):
            raise ValueError("match_at must be arrival or schedule")
        if self.global_write not in ("instant", "link"):
            raise ValueError("global_write must be instant or link")
        if self.mode not in ("pd", "colocated"):
            raise ValueError("mode must be pd or colocated")
        if self.decode_steps not in ("aggregate", "step"):
            raise ValueError("decode_steps must be aggregate or step")
        if not self.slo.tpot > 0:
            raise ValueError("TPOT SLO must be > 0")
        replicas, params = split_replicas(self.dispatch_params)
        make_dispatcher(self.dispatch, **params)  # raises ValueError
        if replicas > 1 and self.dispatch == "immediate":
            raise ValueError("dispatch: replicas need a queue (an order other than immediate)")


def split_replicas(params: dict) -> tuple[int, dict]:
    """``replicas`` (router replicas, each with its own dispatch queue over the shared,
    exact accounting; default 1) apart from the dispatcher's own parameters."""
    rest = dict(params)
    r = rest.pop("replicas", 1)
    if r != int(r) or r < 1:
        raise ValueError("dispatch: replicas must be a whole number >= 1")
    return int(r), rest


def window_overlap(start: float, end: float, ws: float, we: float) -> float:
    """Seconds of the busy interval ``[start, end)`` inside the measurement window
    ``[ws, we)``: what GPU and link utilization over the window count."""
    if start < we and end > ws:
        return (end if end < we else we) - (start if start > ws else ws)
    return 0.0


class _Link:
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


class _Job:
    __slots__ = (
        "tr", "copy", "path", "L", "rem", "pos", "arrival", "ready_at", "local", "glob",
        "est", "kind", "feat", "measured", "req", "matched", "held", "fetched", "fwait",
        "qwait", "out", "t_first", "fin", "admitted",
    )  # fmt: skip


class _Inst:
    __slots__ = (
        "idx", "cache", "waiting", "chunked", "busy", "batch", "q_tokens", "q_seconds",
        "n_jobs", "a_tokens", "link", "last_t", "area", "wake_at", "busy_s", "computed", "busy_w",
        "decode_running", "decode_tokens", "decode_step_s",
    )  # fmt: skip

    def __init__(self, idx: int, cap_blocks: int, link: _Link, locking: bool = False) -> None:
        self.idx = idx
        self.cache = LockingPrefixCache(cap_blocks) if locking else PrefixCache(cap_blocks)
        self.waiting: list[_Job] = []
        self.chunked: _Job | None = None
        self.busy = False
        self.batch: list[tuple[_Job, int]] = []
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


@dataclass(slots=True)
class SimResult:
    metrics: dict
    ttfts: list[float]  # measured requests, in completion order
    imbalance: list[float]  # per window
    per_request: list[tuple] | None = None


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


class Simulator:
    def __init__(
        self,
        trace: Trace,
        policy: str | Policy,
        config: SimConfig | None = None,
        load: LoadSpec | None = None,
    ) -> None:
        self.trace = trace
        self.cfg = config or SimConfig()
        self.cfg.validate()
        self.load = load or LoadSpec(mode=resolve_load_mode(trace))
        hw = self.cfg.hardware
        self.cost: CostModel = hw.cost
        self.bs = trace.block_size
        self.chunk = self.cfg.chunk_tokens or hw.chunk_tokens
        ctx = PolicyContext(
            cost=self.cost,
            slo=self.cfg.slo,
            block_size=self.bs,
            colocated=self.cfg.mode == "colocated",
            chunk_tokens=self.chunk,
        )
        self.policy = (
            make_policy(policy, ctx, **self.cfg.policy_params) if isinstance(policy, str) else policy
        )
        hbm = self.cfg.hbm_tokens if self.cfg.hbm_tokens is not None else hw.hbm_kv_tokens
        cap_blocks = hbm // self.bs
        bw = hw.link_tokens_per_s(self.cfg.link == "shared")
        n = self.cfg.instances
        self.at_schedule = self.cfg.match_at == "schedule"
        self.write_link = self.cfg.global_write == "link"
        lk = self.at_schedule
        if self.cfg.link == "shared":
            per = max(1, hw.gpus_per_server)
            links = [_Link(bw) for _ in range((n + per - 1) // per)]
            self.insts = [self._new_inst(i, cap_blocks, links[i // per], lk) for i in range(n)]
        else:
            self.insts = [self._new_inst(i, cap_blocks, _Link(bw), lk) for i in range(n)]
        # a transfer, once at the head of its link's FIFO, gets the link's full bandwidth;
        # sharing shows up as backlog (InstanceState.fetch_backlog_s)
        self.fetch_bw_est = bw
        self.links = list({id(i.link): i.link for i in self.insts}.values())
        gt = self.cfg.global_tier
        if gt.mode == "none":
            self.glob: PrefixCache | None = None
        else:
            cap = None if gt.mode == "full" else (gt.capacity_tokens or 0) // self.bs
            self.glob = PrefixCache(cap)
        self.fetch_tokens_per_s = self.fetch_bw_est if self.glob is not None else 0.0
        # one view, refreshed in place for every request (build_view)
        self.view = ClusterView(
            now=0.0,
            instances=[InstanceState(i) for i in range(n)],
            block_size=self.bs,
            fetch_tokens_per_s=self.fetch_tokens_per_s,
        )
        # a session id costs a string per request: only for the policies that read it
        self.needs_session_id = self.policy.needs_session_id
        # successors in each agent stream, and first turns of each stream per session
        reqs = trace.requests
        self.next_in_stream = [-1] * len(reqs)
        self.stream_heads: list[list[int]] = [[] for _ in trace.sessions]
        for r in reqs:
            if r.prev >= 0:
                self.next_in_stream[r.prev] = r.idx
            else:
                self.stream_heads[r.session].append(r.idx)
        self._heap: list = []
        self._seq = 0
        self.tpot = hw.decode_tpot_s
        # dispatch: with ``immediate`` every request is routed at its arrival, as before
        # several router replicas: one queue each (requests spread over them round-robin,
        # as a load balancer in front of the replicas would), all over the same instances
        replicas, dparams = split_replicas(self.cfg.dispatch_params)
        self.disps = [make_dispatcher(self.cfg.dispatch, **dparams) for _ in range(replicas)]
        self.disp = self.disps[0]
        self.late = not self.disp.immediate
        # the instances' load as the dispatcher reads it (refreshed before each release)
        self.loads = [InstanceState(i) for i in range(n)]
        self.timer_at = math.inf
        self.depth_max = 0

    def _new_inst(self, idx: int, cap_blocks: int, link: _Link, locking: bool) -> _Inst:
        return _Inst(idx, cap_blocks, link, locking)

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def _acc(self, inst: _Inst, t: float) -> None:
        """Integrate the instance's queue length over time into fixed windows."""
        lt = inst.last_t
        n = inst.n_jobs
        if n and t > lt:
            W = self.cfg.window_s
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

    # ------------------------------------------------------------------ main loop
    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        wall0 = time.perf_counter()
        starts, self.w_start, self.w_end = plan(self.trace, self.load)
        # sessions mode: no arrival after the run's end; compress mode replays every request
        # of the trace (a follow-up delayed past the recorded end is still sent and measured)
        self.horizon = self.w_end if self.load.mode == "sessions" else math.inf
        self.last_arrival = 0.0
        self.max_think = self.load.max_think
        self.mode = self.load.mode
        for lk in self.links:
            lk.ws, lk.we = self.w_start, self.w_end
        for s in starts:
            self._start_session(s)
        # metrics accumulators
        self.n_issued = 0
        self.n_done = 0
        self.m = {
            "requests": 0, "met": 0, "prompt": 0, "prompt_met": 0, "local": 0, "global": 0,
            "computed": 0, "sticks": 0, "migrations": 0, "first_turns": 0, "balance": 0,
            "fetch_tokens": 0, "fetch_wait_s": 0.0, "fetch_requests": 0, "evicted_followups": 0,
            "rematch_short": 0, "rematch_short_tokens": 0, "over_2x": 0, "over_5x": 0,
            "rejected": 0,
        }  # fmt: skip
        self.n_rejected = 0
        self.ttfts: list[float] = []
        self.qwaits: list[float] = []
        heap = self._heap
        pop = heapq.heappop
        next_report = 0.0
        while heap:
            t, _, kind, obj = pop(heap)
            if kind == ARRIVE:
                self._arrive(t, obj)
            elif kind == FORWARD_DONE:
                self._forward_done(t, obj)
            elif kind == WRITTEN:
                self.glob.insert(obj)  # type: ignore[union-attr]
            elif kind == DISPATCH:
                if self.timer_at <= t:
                    self.timer_at = math.inf
                self._pump(t)
            else:
                inst = obj
                if inst.wake_at <= t:
                    inst.wake_at = math.inf
                    self._schedule(inst, t)
            if progress is not None and t >= next_report:
                progress(min(t, self.w_end))
                next_report = t + (self.w_end if math.isfinite(self.w_end) else 3600.0) / 200.0
        self.end_time = max((i.last_t for i in self.insts), default=0.0)
        return self._result(time.perf_counter() - wall0)

    def _start_session(self, s: SessionStart) -> None:
        for ridx in self.stream_heads[s.session]:
            tr = self.trace.requests[ridx]
            t = s.start + tr.offset / s.time_scale
            if t < self.horizon:
                self._push(t, ARRIVE, (tr, s))

    # ------------------------------------------------------------------ routing
    def _arrive(self, now: float, item) -> None:
        tr: TraceRequest
        tr, sess = item
        self.n_issued += 1
        self.last_arrival = now
        L = tr.input_len
        off = sess.replica * self.trace.n_owners
        if off:
            path = self._private(tr.path, off)
        else:
            path = tr.path
        prev_len = 0
        if tr.prev >= 0:
            p = self.trace.requests[tr.prev]
            prev_len = p.input_len + p.output_len
        req = Request(
            prompt_tokens=L,
            turn=tr.turn,
            est_hit=min(prev_len, L),
            session_id=str(sess.copy) if self.needs_session_id else None,
            output_tokens=tr.output_len,
        )
        if not self.late:
            self._route(now, tr, sess, path, req, now, None)
            return
        e = Entry((tr, sess, path), req, now, self.cfg.slo.ttft(L), estimate_size(self.cost, req))
        disps = self.disps
        r = (disps[self.n_issued % len(disps)] if len(disps) > 1 else disps[0]).admit(e, now)
        depth = self._depth()
        if depth > self.depth_max:
            self.depth_max = depth
        if r is not None:
            self._reject(now, r)
        self._pump(now)

    def _route(
        self, now: float, tr: TraceRequest, sess, path, req: Request, arrival: float, mask: list[bool] | None
    ) -> _Inst:
        """Ask the policy where ``req`` goes (among the instances ``mask`` marks, all if
        ``None``) and queue it there; ``arrival`` is when the request came in."""
        L = tr.input_len
        bs = self.bs
        view = build_view(now, self.insts, path, L, bs, self.glob, self.fetch_tokens_per_s, self.view)
        views = view.instances
        g = view.global_hit
        if mask is not None:
            for v, ok in zip(views, mask):
                v.healthy = ok
        d = self.policy.choose(req, view)
        inst = self.insts[d.instance]
        c = views[d.instance].local_hit
        job = _Job()
        job.tr = tr
        job.copy = sess
        job.path = path
        job.L = L
        job.arrival = arrival
        job.qwait = now - arrival
        job.kind = d.kind
        job.req = req
        job.measured = self.w_start <= arrival <= self.w_end
        job.feat = self.policy.feedback(req, views[d.instance])
        if mask is not None:
            for v in views:
                v.healthy = True
        job.matched = not self.at_schedule
        job.held = None
        job.out = tr.output_len
        job.admitted = False
        if c and path and job.matched:
            inst.cache.touch(path, c // bs + 1)
        job.local = c
        job.glob = 0
        job.fetched = 0
        job.fwait = 0.0
        job.ready_at = now
        if g > c:
            # the rest of the prefix comes from the global tier over this instance's link
            job.glob = job.fetched = g - c
            job.ready_at = inst.link.fetch(now, g - c)
            job.fwait = job.ready_at - now
        new = L - c - job.glob
        job.rem = new
        job.pos = L - new
        job.est = self.cost.cost(new, L)
        self._acc(inst, now)
        inst.n_jobs += 1
        inst.a_tokens += L
        inst.q_tokens += new
        inst.q_seconds += job.est
        inst.waiting.append(job)
        self._kick(inst, now)
        return inst

    def _kick(self, inst: _Inst, now: float) -> None:
        """New work reached ``inst``: an idle instance schedules it at once."""
        if not inst.busy:
            self._schedule(inst, now)

    # ------------------------------------------------------------------ dispatch
    def _load(self, inst: _Inst, now: float) -> None:
        s = self.loads[inst.idx]
        s.queued_seconds = inst.q_seconds
        s.running = inst.n_jobs
        fb = inst.link.free_at - now
        s.fetch_backlog_s = fb if fb > 0 else 0.0

    def _pump(self, now: float) -> None:
        """Run the dispatcher's cycle: reject what waited too long, release entries while
        an instance is ready (the policy choosing among the ready ones), set the timer."""
        disps = self.disps
        for disp in disps:
            for r in disp.expire(now):
                self._reject(now, r)
        if not self._depth():
            return
        loads = self.loads
        for inst in self.insts:
            self._load(inst, now)
        # replicas take turns, one release each (one replica: release while ready)
        more = True
        while more:
            more = False
            for disp in disps:
                e = disp.pop(now, loads)
                if e is None:
                    continue
                more = True
                tr, sess, path = e.handle
                inst = self._route(now, tr, sess, path, e.request, e.arrival, disp.ready_mask(loads))
                self._load(inst, now)
        t = min(disp.next_timer(now, loads) for disp in disps)
        if t < self.timer_at:
            self.timer_at = t
            self._push(t, DISPATCH, None)

    def _depth(self) -> int:
        return sum(d.counters.depth for d in self.disps)

    def _reject(self, now: float, r: Rejected) -> None:
        """An explicit overload answer (a live router's 503 / 529): the request is not
        served, and its agent stream ends there (an agent that is refused fails or gives up;
        retries are not modelled)."""
        self.n_rejected += 1
        if self.w_start <= r.entry.arrival <= self.w_end:
            self.m["rejected"] += 1

    def _private(self, path, off: int) -> tuple:
        """Keys of a replayed copy: its own for private blocks, shared ones kept shared."""
        su = self.trace.shared_upto
        out = []
        for o, a, b in path:
            s = su[o]
            if s <= a:
                out.append((o + off, a, b))
            elif s >= b:
                out.append((o, a, b))
            else:
                out.append((o, a, s))
                out.append((o + off, s, b))
        return tuple(out)

    # ------------------------------------------------------------------ instance
    def _schedule(self, inst: _Inst, now: float) -> None:
        if inst.busy:
            return
        t = self._batch(inst, now)
        if inst.batch:
            inst.busy = True
            inst.busy_s += t
            end = now + t
            inst.busy_w += window_overlap(now, end, self.w_start, self.w_end)
            self._push(end, FORWARD_DONE, inst)

    #: the colocated engine gates a job's first batch on KV room (:meth:`_fits`, :meth:`_admit`)
    _gated = False

    def _batch(self, inst: _Inst, now: float) -> float:
        """Form ``inst``'s next prefill batch (``inst.batch``: (job, tokens) pairs) under the
        chunk budget: the chunked job first, then waiting jobs in order, skipping those whose
        KV is still on its way (a WAKE is set for the earliest when nothing else can run).
        Returns the forward's seconds (meaningless when the batch is empty)."""
        budget = self.chunk
        batch = inst.batch
        batch.clear()
        cost = self.cost
        c_lin, c_attn = cost.c_linear, cost.c_attn
        t = cost.c_fwd
        j = inst.chunked
        if j is not None:
            n = j.rem if j.rem < budget else budget
            end = j.pos + n
            t += c_lin * n + c_attn * n * (end - 0.5 * n)
            batch.append((j, n))
            budget -= n
            inst.chunked = None
        if budget > 0 and inst.waiting:
            waiting = inst.waiting
            keep: list[_Job] = []
            earliest = math.inf
            gated = self._gated
            for k, j in enumerate(waiting):
                if budget <= 0:
                    keep.extend(waiting[k:])
                    break
                if j.ready_at > now:
                    keep.append(j)
                    if j.ready_at < earliest:
                        earliest = j.ready_at
                    continue
                if gated and not j.admitted and not self._fits(inst, j):
                    keep.extend(waiting[k:])  # it (and the queue behind it) waits for room
                    break
                if not j.matched:
                    self._match(inst, j, now)
                    if j.ready_at > now:
                        keep.append(j)
                        if j.ready_at < earliest:
                            earliest = j.ready_at
                        continue
                if gated and not j.admitted:
                    self._admit(inst, j)
                n = j.rem if j.rem < budget else budget
                end = j.pos + n
                t += c_lin * n + c_attn * n * (end - 0.5 * n)
                batch.append((j, n))
                budget -= n
            inst.waiting = keep
            if not batch and earliest < inst.wake_at:
                inst.wake_at = earliest
                self._push(earliest, WAKE, inst)
        return t

    def _fits(self, inst: _Inst, j: _Job) -> bool:
        """Whether ``j`` may enter its first batch (with ``_gated``)."""
        return True

    def _admit(self, inst: _Inst, j: _Job) -> None:
        """``j`` enters its first batch (with ``_gated``)."""
        j.admitted = True

    def _match(self, inst: _Inst, j: _Job, now: float) -> None:
        """``match_at=schedule``: the instance matches its prefix cache as the job first
        enters a batch and locks what it matched until the job completes. A shortfall
        against the arrival-time hit is fetched from the global tier if it holds it (the
        job then waits for the transfer), otherwise computed; a gain is reused."""
        j.matched = True
        path = j.path
        if not path:
            return
        bs = self.bs
        L = j.L
        cap = L - 1 if L > 0 else 0
        cache = inst.cache
        c2 = cache.hit(path) * bs
        if c2 > cap:
            c2 = cap
        if c2:
            up = -(-c2 // bs)
            cache.touch(path, up)
            j.held = cache.lock(path, up)  # type: ignore[attr-defined]
        c = j.local
        if c2 == c:
            return
        rem0 = j.rem
        if c2 < c:
            f = 0
            if self.glob is not None:
                gs = self.glob.hit(path) * bs
                top = c if gs > c else gs
                if top > c2:
                    f = top - c2
            j.local = c2
            if f:
                j.glob += f
                j.fetched += f
                j.ready_at = inst.link.fetch(now, f)
                j.fwait += j.ready_at - now
            if j.measured:
                self.m["rematch_short"] += 1
                self.m["rematch_short_tokens"] += c - c2
            j.rem += c - c2 - f
        else:
            d = c2 - c
            j.local = c2
            take = d if d < j.glob else j.glob
            j.glob -= take
            j.rem -= d - take
        j.pos = L - j.rem
        if j.rem != rem0:
            inst.q_tokens += j.rem - rem0
            est = self.cost.cost(j.rem, L)
            inst.q_seconds += est - j.est
            j.est = est

    def _forward_done(self, now: float, inst: _Inst) -> None:
        inst.busy = False
        self._apply_batch(now, inst)
        if self.late and self._depth():
            # work left the instance: release queued requests before it picks its next batch
            self._pump(now)
        self._schedule(inst, now)

    def _apply_batch(self, now: float, inst: _Inst) -> None:
        """The forward of ``inst.batch`` ended: each job's tokens are computed; a job with
        more left is the next chunked one, a finished one :meth:`_complete` s."""
        cost = self.cost
        for j, n in inst.batch:
            j.rem -= n
            j.pos += n
            inst.q_tokens -= n
            inst.computed += n
            if j.rem > 0:
                est = cost.cost(j.rem, j.L)
                inst.q_seconds += est - j.est
                j.est = est
                inst.chunked = j
            else:
                inst.q_seconds -= j.est
                j.est = 0.0
                self._complete(now, inst, j)
        inst.batch.clear()
        if inst.n_jobs == 0:
            inst.q_seconds = 0.0  # drop float drift

    def _complete(self, now: float, inst: _Inst, j: _Job) -> None:
        self._prefill_done(now, inst, j)
        self._answered(j, now + j.tr.output_len * self.tpot)

    def _prefill_done(self, now: float, inst: _Inst, j: _Job) -> None:
        """``j``'s prefill completed at ``now`` (its first token): caches, TTFT metrics."""
        self._acc(inst, now)
        inst.n_jobs -= 1
        inst.a_tokens -= j.L
        self.n_done += 1
        path = j.path
        if path:
            cache = inst.cache
            cache.insert(path)
            if j.held is not None:
                cache.unlock(j.held)  # type: ignore[attr-defined]
                j.held = None
            glob = self.glob
            if glob is not None:
                if self.write_link:
                    # the new KV is written over this instance's link, visible when done
                    new = j.L - glob.hit(path) * self.bs
                    if new > 0:
                        self._push(inst.link.write(now, new), WRITTEN, path)
                    else:
                        glob.insert(path)
                else:
                    glob.insert(path)
        ttft = now - j.arrival
        if j.feat is not None:
            self.policy.observe(j.req, inst.idx, j.feat, ttft)
        if j.measured:
            m = self.m
            L = j.L
            m["requests"] += 1
            m["prompt"] += L
            m["local"] += j.local
            m["global"] += j.glob
            m["computed"] += L - j.local - j.glob
            if j.fetched:
                m["fetch_tokens"] += j.fetched
                m["fetch_wait_s"] += j.fwait
                m["fetch_requests"] += 1
            slo = self.cfg.slo.ttft(L)
            if ttft <= slo:
                m["met"] += 1
                m["prompt_met"] += L
            elif ttft > 2.0 * slo:
                m["over_2x"] += 1
                if ttft > 5.0 * slo:
                    m["over_5x"] += 1
            k = j.kind
            if k is DecisionKind.STICK:
                m["sticks"] += 1
            elif k is DecisionKind.MIGRATE:
                m["migrations"] += 1
            elif k is DecisionKind.FIRST_TURN:
                # a follow-up balanced as if new (SMetric: its session was evicted locally)
                if j.req.turn > 1:
                    m["evicted_followups"] += 1
                else:
                    m["first_turns"] += 1
            else:
                m["balance"] += 1
            self.ttfts.append(ttft)
            self.qwaits.append(j.qwait)

    def _answered(self, j: _Job, answered: float) -> None:
        """``j``'s answer is complete at ``answered``: its agent stream's next turn follows."""
        tr = j.tr
        nxt = self.next_in_stream[tr.idx]
        if nxt >= 0:
            ntr = self.trace.requests[nxt]
            sess = j.copy
            if self.mode == "compress":
                t = max(sess.start + ntr.offset / sess.time_scale, answered)
            else:
                think = ntr.think
                if self.max_think is not None and think > self.max_think:
                    think = self.max_think
                t = answered + think
            if t < self.horizon:
                self._push(t, ARRIVE, (ntr, sess))

    # ------------------------------------------------------------------ results
    def _result(self, wall: float) -> SimResult:
        m = self.m
        W = self.cfg.window_s
        # busy time was counted up to the window's end; an open window (compress mode
        # measuring every request) ends at the end of the run for utilization
        uspan = max(min(self.w_end, self.end_time) - self.w_start, 1e-9)
        if math.isinf(self.w_end):
            self.w_end = max(self.last_arrival, self.w_start)
        span = max(self.w_end - self.w_start, 1e-9)
        imb: list[float] = []
        for inst in self.insts:
            self._acc(inst, self.end_time)
        w_lo = int(self.w_start // W)
        w_hi = int(math.ceil(self.w_end / W))
        n = len(self.insts)
        for w in range(w_lo, w_hi):
            loads = [inst.area.get(w, 0.0) / W for inst in self.insts]
            mean = sum(loads) / n
            if mean > 0:
                imb.append(max(loads) / mean)
        if self._depth() or self.n_issued != self.n_done + self.n_rejected:
            # conservation: every admitted request is served once or rejected explicitly
            raise RuntimeError(
                f"dispatch lost requests: issued {self.n_issued}, served {self.n_done}, "
                f"rejected {self.n_rejected}, still queued {self._depth()}"
            )
        ttfts = sorted(self.ttfts)
        qwaits = sorted(self.qwaits)
        prompt = max(1, m["prompt"])
        nreq = m["requests"]
        # attainment counts a rejected (measured) request as a miss; none without bounds
        admitted = nreq + m["rejected"]
        cs = [d.counters for d in self.disps]
        imb_sorted = sorted(imb)
        metrics = {
            "trace": self.trace.name,
            "policy": self.policy.name,
            "instances": n,
            "hardware": self.cfg.hardware.name,
            "global_tier": self.cfg.global_tier.mode
            if self.cfg.global_tier.mode != "sized"
            else str(self.cfg.global_tier.capacity_tokens),
            "link": self.cfg.link,
            "load_mode": self.load.mode,
            "session_rate": None if self.load.mode == "compress" else round(self._rate(), 6),
            "rate_scale": self.load.rate_scale,
            "requests": m["requests"],
            "requests_total": self.n_done,
            "duration_s": span,
            "prefill_tps_within_slo": m["prompt_met"] / span,
            "prefill_tps": m["prompt"] / span,
            "slo_attainment": m["met"] / admitted if admitted else float("nan"),
            "ttft_p50": _percentile(ttfts, 0.5),
            "ttft_p90": _percentile(ttfts, 0.9),
            "ttft_p99": _percentile(ttfts, 0.99),
            "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else float("nan"),
            "imbalance_mean": sum(imb) / len(imb) if imb else float("nan"),
            "imbalance_p99": _percentile(imb_sorted, 0.99),
            "reuse_total": (m["local"] + m["global"]) / prompt,
            "reuse_local": m["local"] / prompt,
            "reuse_global": m["global"] / prompt,
            "computed_tokens": m["computed"],
            "prompt_tokens": m["prompt"],
            "reused_tokens": m["local"] + m["global"],
            "sticks": m["sticks"],
            "migrations": m["migrations"],
            "first_turns": m["first_turns"],
            "evicted_followups": m["evicted_followups"],
            "balanced": m["balance"],
            "match_at": self.cfg.match_at,
            "global_write": self.cfg.global_write,
            "fetch_tokens": m["fetch_tokens"],
            "fetch_requests": m["fetch_requests"],
            "fetch_wait_s": m["fetch_wait_s"],
            "fetch_wait_mean_s": m["fetch_wait_s"] / m["requests"] if m["requests"] else 0.0,
            "fetch_wait_per_fetch_s": m["fetch_wait_s"] / m["fetch_requests"] if m["fetch_requests"] else 0.0,
            "write_tokens": sum(lk.write_tokens for lk in self.links),
            "rematch_short": m["rematch_short"],
            "rematch_short_tokens": m["rematch_short_tokens"],
            # over the measurement window (busy time inside it / its length); *_run: the
            # whole simulated span, warm-up and drain included
            "link_utilization": sum(lk.busy_w for lk in self.links) / (len(self.links) * uspan),
            "gpu_utilization": sum(i.busy_w for i in self.insts) / (n * uspan),
            "link_utilization_run": sum(lk.busy_s for lk in self.links)
            / (len(self.links) * max(self.end_time, 1e-9)),
            "gpu_utilization_run": sum(i.busy_s for i in self.insts) / (n * max(self.end_time, 1e-9)),
            "dispatch": self.cfg.dispatch_label(),
            # measured requests whose TTFT exceeded 2x / 5x their SLO (the tail that deadline
            # orders may buy their gain with), as shares of the measured requests served
            "over_2x_slo": m["over_2x"] / nreq if nreq else float("nan"),
            "over_5x_slo": m["over_5x"] / nreq if nreq else float("nan"),
            "queue_wait_mean": sum(qwaits) / len(qwaits) if qwaits else float("nan"),
            "queue_wait_p50": _percentile(qwaits, 0.5),
            "queue_wait_p99": _percentile(qwaits, 0.99),
            "queue_wait_max": qwaits[-1] if qwaits else float("nan"),
            "queue_depth_max": self.depth_max,
            "deferrals": sum(c.deferrals for c in cs),
            "aged": sum(c.aged for c in cs),
            "dispatch_replicas": len(self.disps),
            "rejected": self.n_rejected,
            "rejected_measured": m["rejected"],
            "requests_issued": self.n_issued,
            "sim_end_s": self.end_time,
            "sim_wall_s": wall,
            "sim_requests_per_s": self.n_done / wall if wall > 0 else float("nan"),
        }
        return SimResult(metrics=metrics, ttfts=self.ttfts, imbalance=imb)

    def _rate(self) -> float:
        from stack.sim.load import rate_of

        return rate_of(self.load, self.trace)


def simulate(
    trace: Trace, policy: str, config: SimConfig | None = None, load: LoadSpec | None = None
) -> dict:
    """Convenience: run one simulation and return its metrics."""
    return Simulator(trace, policy, config, load).run().metrics
