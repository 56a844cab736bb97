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
from collections.abc import Callable

from stack.policies import Policy
from stack.sim.engine import (
    FORWARD_DONE,
    SimConfig,
    SimResult,
    Simulator,
    _Inst,
    _Job,
    _Link,
    _percentile,
    window_overlap,
)
from stack.sim.load import LoadSpec
from stack.traces.model import Trace


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


class _CInst(_Inst):
    __slots__ = (
        "decs", "steps", "ctx_base", "reserved", "res_out", "cap_blocks", "ver", "iv_k",
        "iv_start", "iv_base", "iv_ctx", "iv_batch", "iv_end",
    )  # fmt: skip

    def __init__(self, idx: int, cap_blocks: int, link: _Link, locking: bool = False) -> None:
        super().__init__(idx, cap_blocks, link, locking)
        self.decs: list[tuple[int, int, _Job]] = []  # (finishing step, seq, job), a heap
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


class ColocatedSimulator(Simulator):
    """The PD simulator with decodes on the prefill instances (module docstring)."""

    def __init__(
        self,
        trace: Trace,
        policy: str | Policy,
        config: SimConfig | None = None,
        load: LoadSpec | None = None,
    ) -> None:
        cfg = config or SimConfig(mode="colocated")
        if cfg.mode != "colocated":
            raise ValueError("ColocatedSimulator runs mode=colocated")
        hw = cfg.hardware
        self.room = cfg.hbm_tokens if cfg.hbm_tokens is not None else hw.hbm_kv_tokens
        super().__init__(trace, policy, cfg, load)
        self.dc = hw.decode
        self.step_mode = self.cfg.decode_steps == "step"
        self.tpot_slo = self.cfg.slo.tpot
        self.keep_requests = False  # tests: per-request records in SimResult.per_request
        self.record_forwards: list[tuple] | None = None  # tests: (inst, start, end, job ids)

    def _new_inst(self, idx: int, cap_blocks: int, link: _Link, locking: bool) -> _Inst:
        return _CInst(idx, cap_blocks, link, locking)

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        self.dec_tokens = 0  # decode tokens emitted (one per running decode per forward)
        self.dec_forwards = 0  # forwards that carried decodes
        self.dec_events = 0  # events those took (aggregate: far fewer than forwards)
        self.dec_expected = 0  # sum of (output tokens - 1) of the requests finished
        self.cm = {"out": 0, "out_met": 0, "met_both": 0, "tpot_met": 0, "tpot_n": 0, "tpot_2x": 0}
        self.tpots: list[float] = []
        self.records: list[tuple] = []
        return super().run(progress)

    # ------------------------------------------------------------------ instance
    def _kick(self, inst: _Inst, now: float) -> None:
        """New work reached ``inst``: an idle instance schedules it, a decoding one ends its
        interval with the step in progress (step by step would pick the work up there)."""
        self._schedule(inst, now)  # type: ignore[arg-type]

    def _schedule(self, inst: _CInst, now: float) -> None:  # type: ignore[override]
        if inst.busy:
            if inst.iv_k > 1:
                self._cut(inst, now)
            return
        t = self._batch(inst, now)
        B = len(inst.decs)
        if inst.batch:
            if B:
                t += self.dc.mixed_extra(B, inst.ctx_base + B * inst.steps, self.cost.c_linear)
            self._start(inst, now, t, 1)
        elif B:
            C = inst.ctx_base + B * inst.steps
            k = 1 if self.step_mode else inst.decs[0][0] - inst.steps
            base = self.dc.base(B)
            inst.iv_base, inst.iv_ctx, inst.iv_batch = base, C, B
            self._start(inst, now, interval_seconds(k, base, self.dc.d_ctx, C, B), k)

    _gated = True

    def _fits(self, inst: _CInst, j: _Job) -> bool:  # type: ignore[override]
        """KV room for the prompt and its output, or nothing else running (a request larger
        than the room still runs alone)."""
        return not inst.reserved or inst.reserved + j.L + j.out <= self.room

    def _admit(self, inst: _CInst, j: _Job) -> None:  # type: ignore[override]
        """The request's prompt and output reserve their KV room; the cache shrinks to what is left."""
        j.admitted = True
        inst.reserved += j.L + j.out
        inst.res_out += j.out
        self._resize(inst)

    def _start(self, inst: _CInst, now: float, dur: float, k: int) -> None:
        inst.busy = True
        inst.iv_k = k
        inst.iv_start = now
        end = now + dur
        inst.iv_end = end
        inst.busy_s += dur
        inst.busy_w += window_overlap(now, end, self.w_start, self.w_end)
        inst.ver += 1
        self._push(end, FORWARD_DONE, (inst, inst.ver))

    def _cut(self, inst: _CInst, now: float) -> None:
        """New work reached a decoding instance: end its interval with the step in progress."""
        d_ctx = self.dc.d_ctx
        base, C, B = inst.iv_base, inst.iv_ctx, inst.iv_batch
        m = steps_within(now - inst.iv_start, base, d_ctx, C, B)
        if m + 1 >= inst.iv_k:
            return  # it ends with the step in progress anyway
        old_end = inst.iv_end
        end = inst.iv_start + interval_seconds(m + 1, base, d_ctx, C, B)
        inst.busy_s -= old_end - end
        inst.busy_w -= window_overlap(end, old_end, self.w_start, self.w_end)
        inst.iv_k = m + 1
        inst.iv_end = end
        inst.ver += 1
        self._push(end, FORWARD_DONE, (inst, inst.ver))

    def _resize(self, inst: _CInst) -> None:
        """The prefix cache gets the room the running requests' output tokens leave."""
        out_blocks = -(-inst.res_out // self.bs)
        cap = inst.cap_blocks - out_blocks
        inst.cache.resize(cap if cap > 0 else 0)

    def _forward_done(self, now: float, item) -> None:  # type: ignore[override]
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
        self._apply_batch(now, inst)
        self._refresh(inst)
        if self.late and self._depth():
            self._pump(now)
        self._schedule(inst, now)

    def _complete(self, now: float, inst: _CInst, j: _Job) -> None:  # type: ignore[override]
        """``j``'s prefill is done: its first token is out and it joins the decode batch."""
        self._prefill_done(now, inst, j)
        self._join(now, inst, j)

    def _join(self, now: float, inst: _CInst, j: _Job) -> None:
        """``j``'s first token is out: it decodes its other tokens in the next forwards."""
        j.t_first = now
        n = j.out if j.out > 1 else 1
        if n == 1:
            j.fin = inst.steps
            self._decode_done(now, inst, j)
            return
        self._seq += 1
        j.fin = inst.steps + n - 1
        heapq.heappush(inst.decs, (j.fin, self._seq, j))
        inst.ctx_base += j.L + 1 - inst.steps

    def _decode_done(self, now: float, inst: _CInst, j: _Job) -> None:
        n = j.out if j.out > 1 else 1
        if n > 1:
            inst.ctx_base -= j.L + 1 - (j.fin - (n - 1))
        self.dec_expected += n - 1
        inst.reserved -= j.L + j.out
        inst.res_out -= j.out
        self._resize(inst)
        tpot = (now - j.t_first) / (n - 1) if n > 1 else 0.0
        if j.measured:
            cm = self.cm
            ttft_ok = j.t_first - j.arrival <= self.cfg.slo.ttft(j.L)
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
        if self.keep_requests:
            self.records.append((j.tr.idx, inst.idx, j.arrival, j.t_first, now, n, tpot, j.measured))
        self._answered(j, now)

    def _refresh(self, inst: _CInst) -> None:
        """The decode load the router's view reads."""
        B = len(inst.decs)
        C = inst.ctx_base + B * inst.steps if B else 0
        inst.decode_running = B
        inst.decode_tokens = C
        inst.decode_step_s = self.dc.mixed_extra(B, C, self.cost.c_linear)

    # ------------------------------------------------------------------ results
    def _result(self, wall: float) -> SimResult:
        res = super()._result(wall)
        left = sum(len(i.decs) for i in self.insts)  # type: ignore[attr-defined]
        if left or self.dec_tokens != self.dec_expected:
            raise RuntimeError(
                f"decode lost tokens: emitted {self.dec_tokens}, expected {self.dec_expected}, "
                f"{left} requests still decoding"
            )
        m = res.metrics
        cm = self.cm
        span = max(m["duration_s"], 1e-9)
        admitted = m["requests"] + m["rejected_measured"]
        tp = sorted(self.tpots)
        tn = cm["tpot_n"]
        m.update(
            {
                "mode": "colocated",
                "decode_steps": self.cfg.decode_steps,
                "tpot_slo_s": self.tpot_slo,
                "tps_within_slo": cm["out_met"] / span,
                "output_tps": cm["out"] / span,
                "output_tokens": cm["out"],
                "slo_attainment_both": cm["met_both"] / admitted if admitted else float("nan"),
                "tpot_attainment": cm["tpot_met"] / tn if tn else float("nan"),
                "over_2x_tpot": cm["tpot_2x"] / tn if tn else float("nan"),
                "tpot_p50": _percentile(tp, 0.5),
                "tpot_p90": _percentile(tp, 0.9),
                "tpot_p99": _percentile(tp, 0.99),
                "tpot_mean": sum(tp) / tn if tn else float("nan"),
                "decode_tokens": self.dec_tokens,
                "decode_forwards": self.dec_forwards,
                "decode_events": self.dec_events,
                "decode_batch_mean": self.dec_tokens / self.dec_forwards if self.dec_forwards else 0.0,
            }
        )
        if self.keep_requests:
            res.per_request = self.records
        return res


def make_simulator(
    trace: Trace, policy: str | Policy, config: SimConfig | None = None, load: LoadSpec | None = None
) -> Simulator:
    """The simulator for ``config.mode``: PD disaggregation or colocation."""
    if config is not None and config.mode == "colocated":
        return ColocatedSimulator(trace, policy, config, load)
    return Simulator(trace, policy, config, load)


__all__ = ["ColocatedSimulator", "interval_seconds", "make_simulator", "steps_within"]
