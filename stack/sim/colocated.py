"""PD colocation: every instance prefills *and* decodes its requests (``SimConfig.mode``).

Per instance, as SGLang runs with chunked prefill and mixed batches: every forward carries
one token of each running decode; a forward with prefill chunks (picked as in the PD
simulator: the unfinished chunked request first, then waiting requests in FCFS order up to
the chunk budget) costs the prefill forward plus what the decodes add to it
(:meth:`~stack.core.cost_model.DecodeCost.mixed_extra`), a forward without
prefill work costs :meth:`~stack.core.cost_model.DecodeCost.step`. The forward
that finishes a request's prefill yields its first token (TTFT); each later forward the
request is carried in yields one more, so a request of ``n`` output tokens leaves after
``n - 1`` more forwards and its TPOT is ``(finish - first token) / (n - 1)``: the mean of
those forwards' durations. Its agent stream's next turn follows ``think`` seconds after.

KV room (the calibration's ``hbm_kv_tokens``) is shared by the running requests and the
prefix cache: a waiting request enters its first prefill batch only when the running
requests' prompts plus output tokens and its own fit (FCFS: the queue waits behind it,
as SGLang's scheduler stops adding when memory is short; a request larger than the room is
admitted alone), and the cache's capacity is the room less the running requests' output
tokens (their prompts are the cache's own blocks). Reservations are the true output
lengths (SGLang estimates them and retracts decodes on overflow: not modelled).

Decode progress is aggregated: with no prefill work to pick, an instance runs its decodes
as one interval of equal batch composition up to the first decode's end (the sum of the
steps' durations in closed form, context growing by the batch size per step); new work
arriving meanwhile (a routed request, a fetch done) cuts the interval at the end of the
step in progress, where step-by-step simulation would have picked it up.
``decode_steps="step"`` runs one event per forward instead (the reference the tests hold
the aggregate against).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from stack.sim.config import SimResult
from stack.sim.events import FORWARD_DONE
from stack.sim.instance import Instance, Job, Link, window_overlap
from stack.stats import percentile

if TYPE_CHECKING:
    from stack.sim.scheduler import Host


def interval_seconds(k: int, base: float, d_ctx: float, context: float, batch: int) -> float:
    """Seconds of ``k`` decode forwards of ``batch`` requests starting at ``context`` tokens:
    step ``i`` costs ``base + d_ctx * (context + i * batch)``."""
    return k * (base + d_ctx * context) + d_ctx * batch * k * (k - 1) * 0.5


def steps_within(tau: float, base: float, d_ctx: float, context: float, batch: int) -> int:
    """The number of whole forwards of such an interval done within ``tau`` seconds."""
    if tau <= 0:
        return 0
    q = 0.5 * d_ctx * batch
    p = base + d_ctx * context - q
    if q <= 0:
        m = int(tau / p) if p > 0 else 0
    else:
        m = int((-p + math.sqrt(p * p + 4.0 * q * tau)) / (2.0 * q))
    while m > 0 and interval_seconds(m, base, d_ctx, context, batch) > tau:
        m -= 1
    while interval_seconds(m + 1, base, d_ctx, context, batch) <= tau:
        m += 1
    return m


class ColocatedInstance(Instance):
    """An instance that also decodes: its running decodes, their KV room, the interval in flight."""

    __slots__ = (
        "decs", "steps", "ctx_base", "reserved", "res_out", "cap_blocks", "ver", "iv_k",
        "iv_start", "iv_base", "iv_ctx", "iv_batch", "iv_end",
    )  # fmt: skip

    def __init__(self, idx: int, cap_blocks: int, link: Link, locking: bool = False) -> None:
        super().__init__(idx, cap_blocks, link, locking)
        self.decs: list[tuple[int, int, Job]] = []  # (finishing step, seq, job), a heap
        self.steps = 0  # forwards that carried decodes so far
        self.ctx_base = 0  # sum over decodes of L + 1 - join step: context = this + B * steps
        self.reserved = 0  # running requests' prompt + output tokens
        self.res_out = 0  # their output tokens
        self.cap_blocks = cap_blocks
        self.ver = 0  # the forward in flight (a cut interval's old end is stale)
        self.iv_k = 0  # forwards in flight: 1, or a decode interval's length
        self.iv_start = 0.0
        self.iv_base = 0.0
        self.iv_ctx = 0
        self.iv_batch = 0
        self.iv_end = 0.0


class ColocatedScheduler:
    """The simulator's scheduler for ``mode=colocated``: decodes on the prefill instances
    (module docstring; the hooks: :class:`~stack.sim.scheduler.Scheduler`)."""

    def __init__(self, sim: Host) -> None:
        self.sim = sim
        cfg = sim.cfg
        hw = cfg.hardware
        self.room = cfg.hbm_tokens if cfg.hbm_tokens is not None else hw.hbm_kv_tokens
        self.dc = hw.decode
        self.step_mode = cfg.decode_steps == "step"
        self.tpot_slo = cfg.slo.tpot
        self.keep_requests = False  # tests: per-request records in SimResult.per_request
        self.record_forwards: list[tuple] | None = None  # tests: (inst, start, end, k, job ids)
        self.seq = 0  # joins, the tie-break of each instance's decode heap
        self.dec_tokens = 0  # decode tokens emitted (one per running decode per forward)
        self.dec_forwards = 0  # forwards that carried decodes
        self.dec_events = 0  # events those took (aggregate: far fewer than forwards)
        self.dec_expected = 0  # sum of (output tokens - 1) of the requests finished
        self.cm = {"out": 0, "out_met": 0, "met_both": 0, "tpot_met": 0, "tpot_n": 0, "tpot_2x": 0}
        self.tpots: list[float] = []
        self.records: list[tuple] = []

    def new_instance(self, idx: int, cap_blocks: int, link: Link, locking: bool) -> ColocatedInstance:
        return ColocatedInstance(idx, cap_blocks, link, locking)

    # ------------------------------------------------------------------ forwards
    def schedule(self, inst: ColocatedInstance, now: float) -> None:
        """Work may run on ``inst``: an idle instance starts its next forward, a decoding one
        ends its interval with the step in progress (step by step would pick the work up there)."""
        if inst.busy:
            if inst.iv_k > 1:
                self._cut(inst, now)
            return
        sim = self.sim
        t = sim.form_batch(inst, now)
        B = len(inst.decs)
        if inst.batch:
            if B:
                t += self.dc.mixed_extra(B, inst.ctx_base + B * inst.steps, sim.cost.c_linear)
            self._start(inst, now, t, 1)
        elif B:
            C = inst.ctx_base + B * inst.steps
            k = 1 if self.step_mode else inst.decs[0][0] - inst.steps
            base = self.dc.base(B)
            inst.iv_base, inst.iv_ctx, inst.iv_batch = base, C, B
            self._start(inst, now, interval_seconds(k, base, self.dc.d_ctx, C, B), k)

    def fits(self, inst: ColocatedInstance, j: Job) -> bool:
        """KV room for the prompt and its output, or nothing else running (a request larger
        than the room still runs alone)."""
        return not inst.reserved or inst.reserved + j.L + j.out <= self.room

    def admit(self, inst: ColocatedInstance, j: Job) -> None:
        """The request's prompt and output reserve their KV room; the cache shrinks to what is left."""
        j.admitted = True
        inst.reserved += j.L + j.out
        inst.res_out += j.out
        self._resize(inst)

    def _start(self, inst: ColocatedInstance, now: float, dur: float, k: int) -> None:
        sim = self.sim
        inst.busy = True
        inst.iv_k = k
        inst.iv_start = now
        end = now + dur
        inst.iv_end = end
        inst.busy_s += dur
        inst.busy_w += window_overlap(now, end, sim.w_start, sim.w_end)
        inst.ver += 1
        sim.push(end, FORWARD_DONE, (inst, inst.ver))

    def _cut(self, inst: ColocatedInstance, now: float) -> None:
        """New work reached a decoding instance: end its interval with the step in progress."""
        sim = self.sim
        d_ctx = self.dc.d_ctx
        base, C, B = inst.iv_base, inst.iv_ctx, inst.iv_batch
        m = steps_within(now - inst.iv_start, base, d_ctx, C, B)
        if m + 1 >= inst.iv_k:
            return  # it ends with the step in progress anyway
        old_end = inst.iv_end
        end = inst.iv_start + interval_seconds(m + 1, base, d_ctx, C, B)
        inst.busy_s -= old_end - end
        inst.busy_w -= window_overlap(end, old_end, sim.w_start, sim.w_end)
        inst.iv_k = m + 1
        inst.iv_end = end
        inst.ver += 1
        sim.push(end, FORWARD_DONE, (inst, inst.ver))

    def _resize(self, inst: ColocatedInstance) -> None:
        """The prefix cache gets the room the running requests' output tokens leave."""
        out_blocks = -(-inst.res_out // self.sim.bs)
        cap = inst.cap_blocks - out_blocks
        inst.cache.resize(cap if cap > 0 else 0)

    def forward_done(self, now: float, item: tuple[ColocatedInstance, int]) -> None:
        inst, ver = item
        if ver != inst.ver:
            return  # an interval's end that a cut moved
        inst.busy = False
        k = inst.iv_k
        inst.iv_k = 0
        decs = inst.decs
        B = len(decs)
        if self.record_forwards is not None:
            self.record_forwards.append((inst.idx, inst.iv_start, now, k, tuple(e[2].tr.idx for e in decs)))
        if B:
            inst.steps += k
            self.dec_tokens += B * k
            self.dec_forwards += k
            self.dec_events += 1
            while decs and decs[0][0] <= inst.steps:
                self._decode_done(now, inst, heapq.heappop(decs)[2])
        sim = self.sim
        sim.apply_batch(now, inst)
        self._refresh(inst)
        sim.release_queued(now)
        self.schedule(inst, now)

    # ------------------------------------------------------------------ decodes
    def first_token(self, now: float, inst: ColocatedInstance, j: Job) -> None:
        """``j``'s first token is out: it decodes its other tokens in the next forwards."""
        j.t_first = now
        n = j.out if j.out > 1 else 1
        if n == 1:
            j.fin = inst.steps
            self._decode_done(now, inst, j)
            return
        self.seq += 1
        j.fin = inst.steps + n - 1
        heapq.heappush(inst.decs, (j.fin, self.seq, j))
        inst.ctx_base += j.L + 1 - inst.steps

    def _decode_done(self, now: float, inst: ColocatedInstance, j: Job) -> None:
        n = j.out if j.out > 1 else 1
        if n > 1:
            inst.ctx_base -= j.L + 1 - (j.fin - (n - 1))
        self.dec_expected += n - 1
        inst.reserved -= j.L + j.out
        inst.res_out -= j.out
        self._resize(inst)
        tpot = (now - j.t_first) / (n - 1) if n > 1 else 0.0
        if j.measured:
            self._count(j, n, tpot)
        if self.keep_requests:
            self.records.append((j.tr.idx, inst.idx, j.arrival, j.t_first, now, n, tpot, j.measured))
        self.sim.answered(j, now)

    def _count(self, j: Job, n: int, tpot: float) -> None:
        """A measured request of ``n`` output tokens left with ``tpot``: the SLO counters."""
        cm = self.cm
        ttft_ok = j.t_first - j.arrival <= self.sim.cfg.slo.ttft(j.L)
        tpot_ok = tpot <= self.tpot_slo
        cm["out"] += n
        if n > 1:
            cm["tpot_n"] += 1
            self.tpots.append(tpot)
            if tpot_ok:
                cm["tpot_met"] += 1
            elif tpot > 2.0 * self.tpot_slo:
                cm["tpot_2x"] += 1
        if ttft_ok and tpot_ok:
            cm["met_both"] += 1
            cm["out_met"] += n

    def _refresh(self, inst: ColocatedInstance) -> None:
        """The decode load the router's view reads."""
        B = len(inst.decs)
        C = inst.ctx_base + B * inst.steps if B else 0
        inst.decode_running = B
        inst.decode_tokens = C
        inst.decode_step_s = self.dc.mixed_extra(B, C, self.sim.cost.c_linear)

    # ------------------------------------------------------------------ results
    def finish(self, res: SimResult) -> None:
        """Every decode token emitted once; the decode metrics; the per-request records."""
        left = sum(len(i.decs) for i in self.sim.insts if isinstance(i, ColocatedInstance))
        if left or self.dec_tokens != self.dec_expected:
            raise RuntimeError(
                f"decode lost tokens: emitted {self.dec_tokens}, expected {self.dec_expected}, "
                f"{left} requests still decoding"
            )
        res.metrics.update(decode_metrics(res.metrics, self))
        if self.keep_requests:
            res.per_request = self.records


__all__ = ["ColocatedInstance", "ColocatedScheduler", "interval_seconds", "steps_within"]


def decode_metrics(m: dict, sched: ColocatedScheduler) -> dict:
    """What PD colocation adds to the metrics ``m`` of its run: output throughput within
    both SLOs, TPOT attainment and distribution, the decode forwards."""
    cm = sched.cm
    span = max(m["duration_s"], 1e-9)
    admitted = m["requests"] + m["rejected_measured"]
    tp = sorted(sched.tpots)
    tn = cm["tpot_n"]
    return {
        "mode": "colocated",
        "decode_steps": sched.sim.cfg.decode_steps,
        "tpot_slo_s": sched.tpot_slo,
        "tps_within_slo": cm["out_met"] / span,
        "output_tps": cm["out"] / span,
        "output_tokens": cm["out"],
        "slo_attainment_both": cm["met_both"] / admitted if admitted else float("nan"),
        "tpot_attainment": cm["tpot_met"] / tn if tn else float("nan"),
        "over_2x_tpot": cm["tpot_2x"] / tn if tn else float("nan"),
        "tpot_p50": percentile(tp, 0.5),
        "tpot_p90": percentile(tp, 0.9),
        "tpot_p99": percentile(tp, 0.99),
        "tpot_mean": sum(tp) / tn if tn else float("nan"),
        "decode_tokens": sched.dec_tokens,
        "decode_forwards": sched.dec_forwards,
        "decode_events": sched.dec_events,
        "decode_batch_mean": sched.dec_tokens / sched.dec_forwards if sched.dec_forwards else 0.0,
    }
