"""The cost model the router learns from the pool it fronts (``router.cost_model``: observe,
learn).

Where the observations come from: the PD hand-off (:mod:`stack.decode_router.handoff`) asks the
prefill worker for SGLang's ``meta_info`` on the prefill half's body only (native
``/generate`` carries it always; a chat completion is sent to the prefill worker
non-streamed with ``return_meta_info``; the decode half, which answers the client, is sent
the client's body unchanged) and hands it to :meth:`CostLearner.record`. With SGLang's
``--enable-metrics`` (the emulator's too) it carries ``prompt_tokens``, ``cached_tokens``,
``queue_time`` and ``forward_entry_time`` / ``prefill_finished_time``: one
:class:`~stack.core.observations.Observation` (new tokens, cached tokens, forward
seconds, queue seconds). ``/v1/completions``, Anthropic and Responses answers carry none.

Batched forwards: SGLang's ``prefill_finished_time - forward_entry_time`` spans every forward
that carried the request, shared with other requests' chunks when the worker was busy, so it
prices a batch, not the request. The fit keeps only observations that ran alone on their
worker, judged three ways: (1) their engine-side interval ``[forward_entry_time,
prefill_finished_time]`` overlaps no other observed request's on the same worker (both are
marked shared, whichever reports first); (2) no prefill half this router sent to that worker
without asking for timings (a path with no ``meta_info``) was in flight meanwhile
(:class:`LoneTracker`, the router's own bookkeeping; conservative, since a prefill answer
drains after its forward); (3) the worker reports no queueing (``queue_time`` at most
``max_queue_s``), which catches other clients' requests. Under load most observations are
shared and the fit waits for quiet moments; a pool that is never idle never gets a trusted
fit, and the router keeps the configured calibration.

Trust (``learn`` switches to the fitted model only then): at least ``min_observations`` lone
observations, new-token counts spanning ``min_span`` (largest / smallest), held-out MAPE (every
``holdout_every``-th observation) at most ``max_mape``, coefficients within the configured
bounds and ``c_linear > 0``. When a refit fails any of them the router falls back to the
configured calibration. Each switch is logged and counted
(``smetric_cost_model_switches_total``).
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from stack.config import CostModelConfig
from stack.core.cost_model import CostModel, Hardware, SwitchableCost, dump_hardware
from stack.core.observations import Observation, from_meta

log = logging.getLogger("stack.router")

TERMS = ("c_linear", "c_attn", "c_fwd")


@dataclass(slots=True)
class Ticket:
    """One prefill half in flight on one worker. ``observed``: its answer will carry timings;
    ``shared``: an unobserved prefill half overlapped it."""

    worker: str
    observed: bool = True
    shared: bool = False


class LoneTracker:
    """Which observed prefill halves overlapped an unobserved one on the same worker (the
    router's own view; observed ones among themselves are judged on the engine's clock)."""

    def __init__(self) -> None:
        self._active: dict[str, list[Ticket]] = collections.defaultdict(list)

    def begin(self, worker: str, observed: bool = True) -> Ticket:
        t = Ticket(worker, observed)
        others = self._active[worker]
        for o in others:
            if not (o.observed and observed):  # two observed ones: judged on the engine clock
                o.shared = True
                t.shared = True
        others.append(t)
        return t

    def end(self, t: Ticket) -> None:
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


@dataclass(frozen=True, slots=True)
class Verdict:
    """The last refit: the model, its errors, and why it is not trusted (empty: trusted)."""

    cost: CostModel | None
    train_mape: float
    holdout_mape: float
    lone: int
    reasons: tuple[str, ...]

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
        self.obs.append(ob)
        self.m.observations.inc()
        lone = sum(1 for o in self.obs if o.alone)
        self.m.buffer.labels("alone").set(lone)
        self.m.buffer.labels("shared").set(len(self.obs) - lone)
        if ob.alone:
            self._since_fit += 1
            if self._since_fit >= self.cfg.refit_every:
                self.refit()
        return ob

    # -- the fit -----------------------------------------------------------------------------
    def refit(self) -> Verdict:
        """Fit the lone observations held, judge the fit, switch the model in use if needed."""
        from stack.core.fit import fit_rows

        self._since_fit = 0
        c = self.cfg
        lone = [o for o in self.obs if o.alone]
        reasons: list[str] = []
        if len(lone) < c.min_observations:
            reasons.append(f"{len(lone)} lone observations, {c.min_observations} needed")
        fit = None
        if len(lone) >= max(6, c.holdout_every + 1):
            n = np.array([o.new_tokens for o in lone], dtype=float)
            span = float(n.max() / max(1.0, n.min()))
            if span < c.min_span:
                reasons.append(f"new tokens span {span:.1f}x, {c.min_span:g}x needed")
            ctx = np.array([o.context for o in lone], dtype=float)
            secs = np.array([o.forward_s for o in lone], dtype=float)
            hold = (np.arange(len(lone)) + 1) % c.holdout_every == 0
            try:
                fit = fit_rows(n, ctx, secs, hold, self.chunk_tokens)
            except ValueError as e:
                reasons.append(str(e))
        if fit is not None:
            reasons += self._judge(fit.cost, fit.holdout_mape)
            v = Verdict(fit.cost, fit.train_mape, fit.holdout_mape, len(lone), tuple(reasons))
        else:
            v = Verdict(None, math.nan, math.nan, len(lone), tuple(reasons) or ("no fit",))
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
                    "cost model: the learned fit is trusted (%d lone observations, held-out MAPE %.1f%%): "
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
                "lone_observations_fitted": v.lone,
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
            f"Learned by the SMetric router from {v.lone} prefills that ran alone on its pool\n"
            "(meta_info prefill_finished_time - forward_entry_time, SGLang --enable-metrics).\n"
            f"Held-out MAPE {v.holdout_mape:.1%}, trusted: {v.trusted}"
            + (f" ({'; '.join(v.reasons)})" if v.reasons else "")
            + f".\nEverything but cost: from the router's configured calibration {self.hw.name}."
        )
        prov = {
            "calibration": {
                "source": "router (router.cost_model)",
                "timing": "engine-side meta_info, lone prefills only",
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
