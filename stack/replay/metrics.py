"""Replay metrics under the simulator's names (``stack.sim.metrics.result``).

Times are reported in *modelled* seconds (wall seconds divided by the time factor) so the
figures compare directly with ``smetric sim`` on the same trace and load: TTFTs, the
measurement window (``duration_s``) and hence prefill TPS within SLO. The SLO is applied in
modelled seconds, i.e. a wall-clock TTFT is checked against the SLO times the time factor.
Wall-clock figures are reported beside them (``*_wall``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from stack.core.types import SLO
from stack.stats import percentile


@dataclass(slots=True)
class Outcome:
    """One replayed request."""

    idx: int  # trace request index
    copy: int
    turn: int
    arrival: float  # modelled seconds since the run's start (scheduled arrival)
    sent_wall: float  # wall seconds since start when it was sent
    prompt_tokens: int  # the server's count (usage) or the builder's estimate
    ttft_wall: float | None = None  # to the answer's first chunk (the first token made)
    ttft_text_wall: float | None = None  # to its first chunk with visible text
    tpot_wall: float | None = None
    e2e_wall: float | None = None
    output_tokens: int = 0
    cached: int | None = None
    cached_local: int | None = None
    cached_global: int | None = None
    error: str | None = None
    measured: bool = False
    # with a client model (stack/replay/driver.py): attempts sent, overload answers and
    # timeouts met; the TTFT and E2E above count from the first attempt
    attempts: int = 1
    refusals: int = 0
    timeouts: int = 0


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+([-+0-9.eEinfaN]+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) for every sample of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def decisions(samples: list[tuple[str, dict, float]]) -> dict[str, float]:
    """Routing decisions by kind from the router's ``smetric_decisions_total`` counter."""
    out: dict[str, float] = {}
    for name, labels, v in samples:
        if name == "smetric_decisions_total":
            k = labels.get("kind", "")
            out[k] = out.get(k, 0.0) + v
    return out


def prefill_inflight(samples: list[tuple[str, dict, float]]) -> dict[str, float]:
    """Per prefill worker: requests whose prefill is not done (``smetric_worker_prefill_requests``,
    the simulator's definition) when the router exports it, else requests in flight
    (``smetric_worker_inflight``, which also counts the decode phase)."""
    pre = {
        labels.get("worker", ""): v
        for name, labels, v in samples
        if name == "smetric_worker_prefill_requests"
    }
    if pre:
        return pre
    return {
        labels.get("worker", ""): v
        for name, labels, v in samples
        if name == "smetric_worker_inflight" and labels.get("role") == "prefill"
    }


@dataclass
class LoadSampler:
    """Per-instance load sampled over time, averaged in windows of ``window`` modelled s."""

    window: float = 30.0
    sums: dict[int, dict[str, float]] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, t_model: float, loads: dict[str, float]) -> None:
        w = int(t_model // self.window)
        d = self.sums.setdefault(w, {})
        for k, v in loads.items():
            d[k] = d.get(k, 0.0) + v
        self.counts[w] = self.counts.get(w, 0) + 1

    def imbalance(self, w_start: float, w_end: float) -> list[float]:
        out = []
        for w, d in sorted(self.sums.items()):
            if (w + 1) * self.window <= w_start or w * self.window >= w_end or not d:
                continue
            n = self.counts[w]
            loads = [v / n for v in d.values()]
            mean = sum(loads) / len(loads)
            if mean > 0:
                out.append(max(loads) / mean)
        return out


def summarize(
    outcomes: list[Outcome],
    *,
    slo: SLO,
    time_factor: float,
    w_start: float,
    w_end: float,
    imbalance: list[float] | None = None,
    decisions_delta: dict[str, float] | None = None,
    extra: dict | None = None,
    clients: str | None = None,
) -> dict:
    """The simulator's metrics from replayed outcomes; ``clients``: the client model's
    description when one ran (adds the simulator's client figures)."""
    tf = time_factor
    span = max(w_end - w_start, 1e-9)
    done = [o for o in outcomes if o.measured and o.error is None and o.ttft_wall is not None]
    failed = [o for o in outcomes if o.measured and o.error is not None]
    ttfts = sorted(o.ttft_wall / tf for o in done)
    texts = sorted(o.ttft_text_wall / tf for o in done if o.ttft_text_wall is not None)
    prompt = sum(o.prompt_tokens for o in done)
    met = [o for o in done if o.ttft_wall / tf <= slo.ttft(o.prompt_tokens)]
    prompt_met = sum(o.prompt_tokens for o in met)
    over = [o.ttft_wall / tf / slo.ttft(o.prompt_tokens) for o in done]
    known = [o for o in done if o.cached is not None]
    kprompt = max(1, sum(o.prompt_tokens for o in known))
    local = sum(o.cached_local or 0 for o in known)
    glob = sum(o.cached_global or 0 for o in known)
    total = sum(o.cached or 0 for o in known)
    split = any(o.cached_local is not None for o in known)
    tpots = sorted(o.tpot_wall / tf for o in done if o.tpot_wall is not None)
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in outcomes:
        if o.error is not None:
            kind = o.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
            examples.setdefault(kind, o.error[:300])
    imb = sorted(imbalance or [])
    dec = decisions_delta or {}
    n_req = len(done) + len(failed)
    nan = float("nan")
    m = {
        "requests": len(done),
        "requests_total": sum(1 for o in outcomes if o.error is None and o.ttft_wall is not None),
        "duration_s": span,
        "prefill_tps_within_slo": prompt_met / span,
        "prefill_tps": prompt / span,
        # failed measured requests count as misses
        "slo_attainment": len(met) / n_req if n_req else nan,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else nan,
        "ttft_max": ttfts[-1] if ttfts else nan,
        # measured requests past 2x / 5x their TTFT SLO (a failed one counts as past), as the
        # simulator's over_2x_slo / over_5x_slo
        "over_2x_slo": (sum(x > 2 for x in over) + len(failed)) / n_req if n_req else nan,
        "over_5x_slo": (sum(x > 5 for x in over) + len(failed)) / n_req if n_req else nan,
        "tpot_p50": percentile(tpots, 0.5),
        "tpot_p90": percentile(tpots, 0.9),
        "imbalance_mean": sum(imb) / len(imb) if imb else nan,
        "imbalance_p99": percentile(imb, 0.99),
        "reuse_total": total / kprompt if known else nan,
        "reuse_local": local / kprompt if known and split else nan,
        "reuse_global": glob / kprompt if known and split else nan,
        "computed_tokens": prompt - total if known else None,
        "prompt_tokens": prompt,
        "reused_tokens": total if known else None,
        "sticks": int(dec["stick"]) if "stick" in dec else None,
        "migrations": int(dec["migrate"]) if "migrate" in dec else None,
        "first_turns": int(dec["first_turn"]) if "first_turn" in dec else None,
        "balanced": int(dec["balance"]) if "balance" in dec else None,
        "errors": len([o for o in outcomes if o.error is not None]),
        "errors_measured": len(failed),
        "error_kinds": errors,
        "error_examples": examples,
        "time_factor": tf,
        # to the first chunk with visible text (stack/replay/driver.py says when it differs)
        "ttft_text_p50": percentile(texts, 0.5),
        "ttft_text_p90": percentile(texts, 0.9),
        "ttft_p50_wall": percentile(sorted(o.ttft_wall for o in done), 0.5),
        "ttft_p90_wall": percentile(sorted(o.ttft_wall for o in done), 0.9),
    }
    if clients is not None:
        meas = [o for o in outcomes if o.measured]
        n_att = sum(o.attempts for o in meas)
        m.update(
            {
                "clients": clients,
                "attempts": n_att,
                "retries": n_att - len(meas),
                "refusals": sum(o.refusals for o in meas),
                "timeouts": sum(o.timeouts for o in meas),
                "failed_after_retries": len(failed),
                "failed_share": len(failed) / n_req if n_req else nan,
            }
        )
    if extra:
        m.update(extra)
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
