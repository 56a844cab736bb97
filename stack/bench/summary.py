"""results.csv <-> rows, and the summary computed from rows alone.

Definitions (docs/definitions.md):

- peak: the highest prefill TPS within SLO over the rates run, and the rate where it is.
- capacity: the highest rate at which at least 90% of the measured requests met the SLO
  (``None`` when no rate did).
- ``smetric_vs_best_baseline``: best SMetric-family peak / best peak among the policies of
  the run that are not SMetric variants; ``smetric_capacity_vs_best_baseline`` likewise
  for capacity; ``faithful_smetric_*``: the same with faithful ``smetric`` alone.
- TTFT p50 / p90 / p99 and the share of requests over 2x / 5x their SLO of every policy
  at SMetric's peak rate (faithful ``smetric`` if it ran, else the best SMetric-family
  policy); the nearest rate run if a policy lacks that rate.
- dispatch (``smetric bench --dispatch``): a run's "policy" in the summary is its label,
  the policy name for the default ``immediate`` order and ``policy+order`` otherwise
  (:func:`run_label`); each entry says its ``policy`` and ``dispatch``. The ratios compare
  labels (a baseline with a dispatch order is still a baseline).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from stack.dispatch import SIM_DISPATCH
from stack.policies import is_smetric

TPS = "prefill_tps_within_slo"
ATT = "slo_attainment"
CAPACITY_ATTAINMENT = 0.9

# columns that are not numbers even when they look like one
TEXT_COLUMNS = {
    "experiment",
    "setting",
    "setting_params",
    "rate_unit",
    "trace",
    "policy",
    "hardware",
    "global_tier",
    "link",
    "load_mode",
    "dispatch",
    "match_at",
    "global_write",
    "mode",
    "decode_steps",
}

DEFAULT_DISPATCH = SIM_DISPATCH.label()  # "immediate": a run that names no order


def run_label(policy: str, dispatch: str | None = None) -> str:
    """How a (policy, dispatch order) pair is named in summaries, tables and plots."""
    if not dispatch or dispatch == DEFAULT_DISPATCH:
        return policy
    return f"{policy}+{dispatch}"


def row_label(row: dict) -> str:
    d = row.get("dispatch")
    return run_label(str(row["policy"]), None if d is None or d == "" else str(d))


def _num(v):
    if v is None or v == "":
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    if (
        f.is_integer()
        and isinstance(v, str)
        and "." not in v
        and "e" not in v.lower()
        and "n" not in v.lower()
    ):
        return int(f)
    return f


def write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as fh:
        return [{k: (v if k in TEXT_COLUMNS else _num(v)) for k, v in r.items()} for r in csv.DictReader(fh)]


def _f(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0


def peak(rows: list[dict]) -> dict | None:
    """The row with the highest TPS within SLO (lowest rate on ties)."""
    if not rows:
        return None
    return max(sorted(rows, key=lambda r: float(r["rate"])), key=lambda r: _f(r.get(TPS)))


def capacity(rows: list[dict]) -> float | None:
    ok = [float(r["rate"]) for r in rows if _f(r.get(ATT)) >= CAPACITY_ATTAINMENT]
    return max(ok) if ok else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def at_rate(rows: list[dict], rate: float) -> dict | None:
    if not rows:
        return None
    return min(rows, key=lambda r: (abs(math.log(float(r["rate"]) / rate)), float(r["rate"])))


#: a policy's figures at its peak rate, in summary.json (``at_peak``)
AT_PEAK_KEYS = (
    ATT,
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "over_2x_slo",
    "over_5x_slo",
    "queue_wait_p99",
    "rejected",
    "reuse_total",
    "reuse_local",
    "reuse_global",
    "imbalance_mean",
    "imbalance_p99",
    "sticks",
    "migrations",
    "first_turns",
    "evicted_followups",
    "balanced",
    "gpu_utilization",
    "link_utilization",
    "requests",
    "ttft_max",
    "session_slowdown_p90",
    "sessions_failed",
    # with the client model (--clients; absent without it)
    "failed_after_retries",
    "failed_share",
)  # fmt: skip


def _policy_summary(name: str, prs: list[dict], bound: dict | None) -> dict:
    """One policy's (label's) rows: its peak, capacity, rates and figures at the peak."""
    pk = peak(prs)
    d = pk.get("dispatch")
    s = {
        "policy": str(pk["policy"]),
        "dispatch": DEFAULT_DISPATCH if d is None or d == "" else str(d),
        "smetric_family": is_smetric(name),
        "peak_prefill_tps_within_slo": _f(pk.get(TPS)),
        "peak_rate": float(pk["rate"]),
        "capacity": capacity(prs),
        "rates": sorted(float(r["rate"]) for r in prs),
        "at_peak": {k: pk.get(k) for k in AT_PEAK_KEYS},
    }
    ub = (bound or {}).get("prefill_tps_within_slo") or (bound or {}).get("prefill_tps")
    if ub:
        s["peak_vs_upper_bound"] = s["peak_prefill_tps_within_slo"] / ub
    return s


def _reference_smetric(pol: dict[str, dict]) -> str | None:
    """The SMetric whose peak rate the others are read at: smetric, else the family's best."""
    if "smetric" in pol:
        return "smetric"
    fam = [p for p in pol if is_smetric(p)]
    return max(fam, key=lambda p: pol[p]["peak_prefill_tps_within_slo"]) if fam else None


def _at_rate_figures(r: dict) -> dict:
    return {
        "rate": float(r["rate"]),
        "ttft_p50": r.get("ttft_p50"),
        "ttft_p90": r.get("ttft_p90"),
        "ttft_p99": r.get("ttft_p99"),
        "over_2x_slo": r.get("over_2x_slo"),
        "over_5x_slo": r.get("over_5x_slo"),
        "ttft_max": r.get("ttft_max"),
        "session_slowdown_p90": r.get("session_slowdown_p90"),
        "failed_after_retries": r.get("failed_after_retries"),
        TPS: r.get(TPS),
        ATT: r.get(ATT),
    }


def summarize_setting(rows: list[dict], bound: dict | None = None) -> dict:
    """Summary of one setting's rows (all policies)."""
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(row_label(r), []).append(r)
    pol = {name: _policy_summary(name, prs, bound) for name, prs in by_policy.items()}
    # SMetric's peak rate, and every policy's TTFT there
    ref_name = _reference_smetric(pol)
    ref_rate = pol[ref_name]["peak_rate"] if ref_name else None
    if ref_rate is not None:
        for name, prs in by_policy.items():
            pol[name]["at_smetric_peak_rate"] = _at_rate_figures(at_rate(prs, ref_rate))
    fam = {p: v for p, v in pol.items() if v["smetric_family"]}
    base = {p: v for p, v in pol.items() if not v["smetric_family"]}

    def best(d: dict, key: str) -> tuple[str | None, float | None]:
        vals = [(p, v[key]) for p, v in d.items() if v[key] is not None]
        if not vals:
            return None, None
        return max(vals, key=lambda x: x[1])

    bf_name, bf_peak = best(fam, "peak_prefill_tps_within_slo")
    bb_name, bb_peak = best(base, "peak_prefill_tps_within_slo")
    _, bf_cap = best(fam, "capacity")
    bbc_name, bb_cap = best(base, "capacity")
    sm = pol.get("smetric")
    out = {
        "policies": pol,
        "dispatch_orders": sorted({v["dispatch"] for v in pol.values()}),
        "smetric_peak_rate": ref_rate,
        "reference_smetric": ref_name,
        "best_smetric": bf_name,
        "best_baseline": bb_name,
        "best_baseline_by_capacity": bbc_name,
        "smetric_vs_best_baseline": _ratio(bf_peak, bb_peak),
        "smetric_capacity_vs_best_baseline": _ratio(bf_cap, bb_cap),
        "faithful_smetric_vs_best_baseline": _ratio(sm["peak_prefill_tps_within_slo"], bb_peak)
        if sm
        else None,
        "faithful_smetric_capacity_vs_best_baseline": _ratio(sm["capacity"], bb_cap) if sm else None,
    }
    # P90 TTFT at SMetric's peak rate vs the best baseline's there (the paper: 19% lower)
    if ref_name and bb_name and "at_smetric_peak_rate" in pol[bb_name]:
        a = pol[ref_name]["at_smetric_peak_rate"]["ttft_p90"]
        b = pol[bb_name]["at_smetric_peak_rate"]["ttft_p90"]
        out["smetric_ttft_p90_vs_best_baseline"] = (
            _ratio(a, b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None
        )
    if bound:
        out["upper_bound"] = bound
    return out


def summarize(rows: list[dict], bounds: dict[str, dict] | None = None, meta: dict | None = None) -> dict:
    """The whole summary: per setting (in the order first seen), plus the first setting's
    figures mirrored at the top level for convenience."""
    order: list[str] = []
    by_setting: dict[str, list[dict]] = {}
    for r in rows:
        s = str(r["setting"])
        if s not in by_setting:
            order.append(s)
            by_setting[s] = []
        by_setting[s].append(r)
    settings = {s: summarize_setting(by_setting[s], (bounds or {}).get(s)) for s in order}
    out: dict = dict(meta or {})
    out["settings"] = settings
    if order:
        out.update({k: v for k, v in settings[order[0]].items()})
        out["main_setting"] = order[0]
    return out


def clean(obj):
    """JSON-safe: NaN / inf -> None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj
