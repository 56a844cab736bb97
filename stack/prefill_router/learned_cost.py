"""The cost model the router learns from the pool it fronts (``router.cost_model``: observe,
learn).

Where the observations come from: the PD hand-off (:mod:`stack.decode_router.handoff`) asks the
prefill worker for SGLang's ``meta_info`` on the prefill half only
(:func:`stack.decode_router.prefill_meta.meta_request`: native ``/generate`` carries it
always; a chat completion is sent non-streamed with ``return_meta_info``; an Anthropic
Messages request's prefill half is sent as the chat request SGLang itself makes of it; the
decode half, which answers the client, is sent the client's body unchanged) and hands it to
:meth:`CostLearner.record`. With SGLang's ``--enable-metrics`` (the emulator's too) it carries
``prompt_tokens``, ``cached_tokens``, ``queue_time`` and ``forward_entry_time`` /
``prefill_finished_time``: one :class:`~stack.core.observations.Observation`.
``/v1/completions`` and Responses prefill halves give none (unobserved).

Batched forwards: SGLang's ``prefill_finished_time - forward_entry_time`` spans every forward
that carried the request, shared with other requests' chunks when the worker was busy, so it
prices a batch, not the request. The fit therefore takes *busy stretches* (:func:`stretches`):
the observations of one worker whose engine-side intervals chain-overlap. Their forwards ran
back to back, every one but the last full, so the stretch's span is the work of all its
members plus ``c_fwd`` per forward (:func:`stack.core.fit.batch_features`); a lone prefill is
a stretch of one. A stretch is fitted only when nothing unseen ran in it
(:meth:`CostLearner.rows`): it is complete (every prefill half sent to the worker before its
last member was recorded has answered), none of its members overlapped a prefill half that
gave no timing (:class:`LoneTracker`, the router's own bookkeeping), and the worker was not
busy with unseen work when it began (its first member queued at most ``max_queue_s``, or the
worker's previous stretch ended within that of its start). Other clients' requests batched
into a stretch are not detected. Each observation is still marked ``alone`` when its interval
overlapped no other (:class:`Intervals`; exported, and what ``smetric calibrate --from``
fits).

Trust (``learn`` switches to the fitted model only then): at least ``min_observations`` rows
(stretches), new-token totals spanning ``min_span`` (largest / smallest), held-out MAPE (one
row in each ``holdout_every``, :func:`stack.core.fit.held_out`) at most ``max_mape``,
coefficients within the configured bounds and ``c_linear > 0``. When a refit fails any of
them the router falls back to the configured calibration. Each switch is logged and counted
(``smetric_cost_model_switches_total``).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from stack.config import CostModelConfig
from stack.core.cost_model import CostModel, Hardware, SwitchableCost, dump_hardware
from stack.core.observations import Observation, from_meta

log = logging.getLogger("stack.router")

TERMS = ("c_linear", "c_attn", "c_fwd")
#: a refit comes every ``refit_every`` observations, or every 1/REFIT_SHARE of those held when
#: that is more: a refit's cost grows with the buffer, and this keeps it a bounded share
#: of the router's time per observation
REFIT_SHARE = 20


@dataclass(slots=True, eq=False)
class Ticket:
    """One prefill half in flight on one worker. ``observed``: its answer will carry timings;
    ``shared``: a prefill half that gave no timing overlapped it (an unobserved path, or an
    observed one whose answer had none); ``seq``: the order it was sent in (router-wide);
    ``recorded``: its timing was read."""

    worker: str
    observed: bool = True
    shared: bool = False
    seq: int = 0
    recorded: bool = False
    peers: list[Ticket] = field(default_factory=list)


class LoneTracker:
    """Which observed prefill halves overlapped an unobserved one on the same worker (the
    router's own view; observed ones among themselves are judged on the engine's clock)."""

    def __init__(self) -> None:
        self._active: dict[str, list[Ticket]] = collections.defaultdict(list)
        self.seq = 0

    def begin(self, worker: str, observed: bool = True) -> Ticket:
        self.seq += 1
        t = Ticket(worker, observed, seq=self.seq)
        others = self._active[worker]
        for o in others:
            if not (o.observed and observed):  # two observed ones: judged on the engine clock
                o.shared = True
                t.shared = True
            elif len(o.peers) < 256:  # both observed: shared only if one ends without a timing
                o.peers.append(t)
                t.peers.append(o)
        others.append(t)
        return t

    def first_active(self, worker: str) -> float:
        """The ``seq`` of the oldest prefill half on ``worker`` whose timing is still to come
        (inf: none)."""
        return min((t.seq for t in self._active.get(worker, ()) if not t.recorded), default=math.inf)

    def end(self, t: Ticket) -> None:
        if t.observed and not t.recorded:  # its work ran unseen beside its peers
            for o in t.peers:
                o.shared = True
        t.peers = []
        lst = self._active.get(t.worker)
        if lst is not None:
            try:
                lst.remove(t)
            except ValueError:
                pass
            if not lst:
                del self._active[t.worker]


class Intervals:
    """The recent observations of each worker, to mark the ones whose forwards overlapped
    (engine-side intervals: exact, whichever of the two reports first)."""

    def __init__(self, keep: int = 256) -> None:
        self._recent: dict[str, collections.deque[Observation]] = collections.defaultdict(
            lambda: collections.deque(maxlen=keep)
        )

    def add(self, ob: Observation) -> None:
        recent = self._recent[ob.worker]
        if ob.t > 0:
            for o in recent:
                if o.t < ob.end and ob.t < o.end:
                    o.alone = False
                    ob.alone = False
        recent.append(ob)


@dataclass(slots=True)
class Held:
    """An observation with what judging its busy stretch needs: its ticket (``shared`` may be
    set after it was recorded) and the last ``seq`` sent when it was recorded (every prefill
    half that could have shared its forwards was sent by then)."""

    ob: Observation
    ticket: Ticket
    sent_by: int


@dataclass(slots=True)
class Stretch:
    """A busy stretch: its members, when its first forward began and its last prefill ended
    (engine clock), and the last ``seq`` sent when any member was recorded."""

    members: list[Held]
    start: float
    end: float
    sent_by: int

    def __len__(self) -> int:
        return len(self.members)

    @property
    def tainted(self) -> bool:
        """A member overlapped a prefill half that gave no timing."""
        return any(h.ticket.shared for h in self.members)


def stretches(held: Sequence[Held]) -> list[Stretch]:
    """One worker's observations (engine clock known) grouped into busy stretches: maximal
    groups whose intervals ``[forward_entry_time, prefill_finished_time]`` chain-overlap, in
    time order. Two prefills that merely touch (one's first forward right after the other's
    last) are in different stretches."""
    out: list[Stretch] = []
    cur: Stretch | None = None
    for h in sorted((h for h in held if h.ob.t > 0), key=lambda h: h.ob.t):
        t, end = h.ob.t, h.ob.end
        if cur is not None and t < cur.end:
            cur.members.append(h)
            if end > cur.end:
                cur.end = end
            if h.sent_by > cur.sent_by:
                cur.sent_by = h.sent_by
        else:
            cur = Stretch([h], t, end, h.sent_by)
            out.append(cur)
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    """The last refit: the model, its errors, and why it is not trusted (empty: trusted)."""

    cost: CostModel | None
    train_mape: float
    holdout_mape: float
    lone: int  # rows fitted: lone prefills and busy stretches
    reasons: tuple[str, ...]
    batched: int = 0  # requests in the stretches of more than one

    @property
    def trusted(self) -> bool:
        return self.cost is not None and not self.reasons


class _Metrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.observations = Counter(
            "smetric_cost_model_observations", "prefill timings read from prefill answers", registry=r
        )
        self.missing = Counter(
            "smetric_cost_model_missing_timings",
            "prefill answers without forward timings (workers need --enable-metrics)",
            registry=r,
        )
        self.buffer = Gauge(
            "smetric_cost_model_buffer",
            "observations held (alone: no other request shared their forwards, as far as known)",
            ["kind"],
            registry=r,
        )
        self.coef = Gauge(
            "smetric_cost_model_coefficient",
            "cost model coefficients (model: configured, learned, active)",
            ["model", "term"],
            registry=r,
        )
        self.mape = Gauge("smetric_cost_model_heldout_mape", "held-out MAPE of the learned fit", registry=r)
        self.trusted = Gauge(
            "smetric_cost_model_trusted", "1 when the learned fit is trustworthy", registry=r
        )
        self.active = Gauge(
            "smetric_cost_model_learned_active", "1 when the router prices with the learned model", registry=r
        )
        self.switches = Counter(
            "smetric_cost_model_switches", "switches of the active cost model", ["to"], registry=r
        )

    def set_coef(self, model: str, c: CostModel) -> None:
        for k in TERMS:
            self.coef.labels(model, k).set(getattr(c, k))


class CostLearner:
    """Records prefill timings, refits, and (``learn``) switches the router's cost model."""

    def __init__(
        self,
        hw: Hardware,
        cfg: CostModelConfig,
        registry: CollectorRegistry | None = None,
        switch: SwitchableCost | None = None,
    ) -> None:
        self.hw = hw
        self.cfg = cfg
        self.configured = hw.cost
        self.chunk_tokens = hw.chunk_tokens
        self.switch = switch if cfg.mode == "learn" else None
        self.obs: collections.deque[Observation] = collections.deque(maxlen=cfg.buffer)
        self.held: collections.deque[Held] = collections.deque(maxlen=cfg.buffer)
        self.tracker = LoneTracker()
        self.intervals = Intervals()
        self.verdict = Verdict(None, math.nan, math.nan, 0, ("no fit yet",))
        self.using_learned = False
        self.switches = 0
        self._since_fit = 0
        self.m = _Metrics(registry or CollectorRegistry())
        self.m.set_coef("configured", self.configured)
        self.m.set_coef("active", self.configured)

    # -- the PD hand-off's hooks -------------------------------------------------------------
    def begin(self, worker: str, observed: bool = True) -> Ticket:
        return self.tracker.begin(worker, observed)

    def end(self, t: Ticket) -> None:
        self.tracker.end(t)

    def record(self, t: Ticket, meta: Any) -> Observation | None:
        """A prefill half's ``meta_info`` (None: its answer had none). Never raises."""
        try:
            return self._record(t, meta)
        except Exception:  # learning must never fail a request
            log.exception("cost model: recording an observation")
            return None

    def _record(self, t: Ticket, meta: Any) -> Observation | None:
        ob = from_meta(meta, t.worker, not t.shared)
        if ob is None:
            self.m.missing.inc()
            return None
        if ob.queue_s > self.cfg.max_queue_s:
            ob.alone = False
        self.intervals.add(ob)  # may mark it and an earlier one shared
        t.recorded = True
        self.obs.append(ob)
        self.held.append(Held(ob, t, self.tracker.seq))
        self.m.observations.inc()
        lone = sum(1 for o in self.obs if o.alone)
        self.m.buffer.labels("alone").set(lone)
        self.m.buffer.labels("shared").set(len(self.obs) - lone)
        self._since_fit += 1
        if self._since_fit >= max(self.cfg.refit_every, len(self.held) // REFIT_SHARE):
            self.refit()
        return ob

    def rows(self) -> list[Stretch]:
        """The busy stretches fit for fitting (a lone prefill is a stretch of one), oldest
        first. A stretch is kept when (1) it is complete: every prefill half sent to its worker
        before its last member was recorded has answered; (2) no member overlapped a prefill
        half that gave no timing (:class:`LoneTracker`); (3) the worker was not busy with unseen
        work when it began: its first member queued at most ``max_queue_s``, or the worker's
        previous stretch ended within ``max_queue_s`` of its start (the queueing was behind
        observed work); (4) its start is not cut off by the buffer's end."""
        by_worker: dict[str, list[Held]] = collections.defaultdict(list)
        for h in self.held:
            by_worker[h.ob.worker].append(h)
        full = len(self.held) == self.held.maxlen
        tol = self.cfg.max_queue_s
        out: list[Stretch] = []
        for worker, hs in by_worker.items():
            first_active = self.tracker.first_active(worker)
            prev_end = -math.inf
            for i, g in enumerate(stretches(hs)):
                ok = (
                    g.sent_by < first_active
                    and (g.members[0].ob.queue_s <= tol or g.start - prev_end <= tol)
                    and not (full and i == 0)
                    and not g.tainted
                )
                prev_end = g.end
                if ok:
                    out.append(g)
        out.sort(key=lambda g: g.start)
        return out

    # -- the fit -----------------------------------------------------------------------------
    def refit(self) -> Verdict:
        """Fit the busy stretches held (:meth:`rows`), judge the fit, switch the model in use if
        needed."""
        from stack.core.fit import batch_features, fit_batches, held_out

        self._since_fit = 0
        c = self.cfg
        rows = self.rows()
        reasons: list[str] = []
        if len(rows) < c.min_observations:
            reasons.append(
                f"{len(rows)} rows (lone observations or busy stretches), {c.min_observations} needed"
            )
        fit = None
        if len(rows) >= max(6, c.holdout_every + 1):
            members = [(h.ob.new_tokens, h.ob.context, i) for i, g in enumerate(rows) for h in g.members]
            n, ctx, group = (np.array(col) for col in zip(*members))
            feats = batch_features(n, ctx, group, self.chunk_tokens)
            span = float(feats[:, 0].max() / max(1.0, feats[:, 0].min()))
            if span < c.min_span:
                reasons.append(f"new tokens span {span:.1f}x, {c.min_span:g}x needed")
            secs = np.array([g.end - g.start for g in rows], dtype=float)
            hold = held_out(len(rows), c.holdout_every)
            try:
                fit = fit_batches(feats, np.maximum(secs, 1e-9), hold)
            except ValueError as e:
                reasons.append(str(e))
        batched = sum(len(g) for g in rows if len(g) > 1)
        if fit is not None:
            reasons += self._judge(fit.cost, fit.holdout_mape)
            v = Verdict(fit.cost, fit.train_mape, fit.holdout_mape, len(rows), tuple(reasons), batched)
        else:
            v = Verdict(None, math.nan, math.nan, len(rows), tuple(reasons) or ("no fit",), batched)
        self.verdict = v
        self._export(v)
        self._switch(v)
        return v

    def _judge(self, m: CostModel, holdout_mape: float) -> list[str]:
        c = self.cfg
        out = []
        if math.isnan(holdout_mape) or holdout_mape > c.max_mape:
            out.append(f"held-out MAPE {holdout_mape:.1%} above {c.max_mape:.0%}")
        if not 0 < m.c_linear <= c.max_c_linear:
            out.append(f"c_linear {m.c_linear:.3g} outside (0, {c.max_c_linear:g}]")
        if m.c_attn > c.max_c_attn:
            out.append(f"c_attn {m.c_attn:.3g} above {c.max_c_attn:g}")
        if m.c_fwd > c.max_c_fwd:
            out.append(f"c_fwd {m.c_fwd:.3g} above {c.max_c_fwd:g}")
        return out

    def _export(self, v: Verdict) -> None:
        if v.cost is not None:
            self.m.set_coef("learned", v.cost)
        self.m.mape.set(v.holdout_mape if not math.isnan(v.holdout_mape) else -1.0)
        self.m.trusted.set(1.0 if v.trusted else 0.0)

    def _switch(self, v: Verdict) -> None:
        if self.switch is None:
            return
        if v.trusted and (not self.using_learned or self.switch.model != v.cost):
            if not self.using_learned:
                self.switches += 1
                self.m.switches.labels("learned").inc()
                log.warning(
                    "cost model: the learned fit is trusted (%d rows, held-out MAPE %.1f%%): "
                    "pricing prefills with c_linear=%.4g c_attn=%.4g c_fwd=%.4g instead of %s's",
                    v.lone,
                    100 * v.holdout_mape,
                    v.cost.c_linear,
                    v.cost.c_attn,
                    v.cost.c_fwd,
                    self.hw.name,
                )
            self.using_learned = True
            self.switch.use(v.cost)
        elif not v.trusted and self.using_learned:
            self.switches += 1
            self.m.switches.labels("configured").inc()
            log.warning(
                "cost model: the learned fit is no longer trusted (%s): back to %s's calibration",
                "; ".join(v.reasons),
                self.hw.name,
            )
            self.using_learned = False
            self.switch.use(self.configured)
        self.m.active.set(1.0 if self.using_learned else 0.0)
        self.m.set_coef("active", self.switch.model)

    # -- what the admin API shows ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        v = self.verdict
        lone = sum(1 for o in self.obs if o.alone)

        def coefs(m: CostModel | None) -> dict | None:
            return None if m is None else {k: getattr(m, k) for k in TERMS}

        return {
            "mode": self.cfg.mode,
            "active": "learned" if self.using_learned else "configured",
            "configured": {"hardware": self.hw.name, **coefs(self.configured)},
            "learned": {
                "coefficients": coefs(v.cost),
                "trusted": v.trusted,
                "reasons": list(v.reasons),
                "train_mape": None if math.isnan(v.train_mape) else v.train_mape,
                "holdout_mape": None if math.isnan(v.holdout_mape) else v.holdout_mape,
                "rows_fitted": v.lone,
                "lone_observations_fitted": v.lone,
                "batched_requests_fitted": v.batched,
            },
            "observations": {"held": len(self.obs), "alone": lone, "shared": len(self.obs) - lone},
            "switches": self.switches,
            "trust": {
                "min_observations": self.cfg.min_observations,
                "min_span": self.cfg.min_span,
                "max_mape": self.cfg.max_mape,
            },
        }

    def calibration_text(self) -> str | None:
        """The learned model as a calibration file (``--hardware FILE``), None before a fit;
        the keys a prefill timing cannot tell come from the configured calibration."""
        v = self.verdict
        if v.cost is None:
            return None
        hw = replace(
            self.hw, name=f"{self.hw.name}-learned", cost=v.cost, description="learned by the router"
        )
        head = (
            f"Learned by the SMetric router from {v.lone} busy stretches of its pool (lone prefills\n"
            f"and back-to-back batches, {v.batched} requests in batches; meta_info\n"
            "forward_entry_time / prefill_finished_time, SGLang --enable-metrics).\n"
            f"Held-out MAPE {v.holdout_mape:.1%}, trusted: {v.trusted}"
            + (f" ({'; '.join(v.reasons)})" if v.reasons else "")
            + f".\nEverything but cost: from the router's configured calibration {self.hw.name}."
        )
        prov = {
            "calibration": {
                "source": "router (router.cost_model)",
                "timing": "engine-side meta_info, busy stretches (lone prefills and batches)",
                "prefill": {
                    "train_mape": _r(v.train_mape),
                    "holdout_mape": _r(v.holdout_mape),
                    "lone_observations": v.lone,
                    "trusted": v.trusted,
                },
            }
        }
        return dump_hardware(hw, head, prov)


def _r(x: float) -> float | None:
    return None if math.isnan(x) else float(f"{x:.6g}")
