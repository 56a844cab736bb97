"""The colocation comparison's summary (``smetric bench --experiment colocation``).

Under PD colocation the paper scores a scheduler by its *TPS within SLO*: output tokens
per second of the requests that met both the TTFT SLO and the TPOT SLO (§5.2), and reports
median TTFT and P90 TPOT beside it. From the bench's rows alone (``mode=colocated``), per
setting and policy: the peak of ``tps_within_slo`` over the rates run and, at that peak and
at SMetric's peak rate, TTFT p50 / p99, TPOT p50 / p90, the shares of requests past 2x
their TTFT or TPOT SLO; and SMetric's peak over the best baseline's.
"""

from __future__ import annotations

import math

from stack.bench.summary import row_label
from stack.policies import is_smetric

KEY = "tps_within_slo"
AT = (
    "tps_within_slo", "output_tps", "slo_attainment_both", "slo_attainment", "tpot_attainment",
    "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p90", "over_2x_slo", "over_2x_tpot",
    "reuse_total", "reuse_local", "migrations", "decode_batch_mean", "gpu_utilization",
)  # fmt: skip


def _f(v) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def _pick(row: dict) -> dict:
    return {"rate": float(row["rate"]), **{k: row.get(k) for k in AT}}


def summarize_colocation(rows: list[dict]) -> dict:
    """Per setting: per policy its peak and its figures at SMetric's peak rate."""
    by: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        if r.get("mode") != "colocated":
            continue
        by.setdefault(str(r["setting"]), {}).setdefault(row_label(r), []).append(r)
    out: dict = {}
    for setting, pols in by.items():
        peaks = {
            p: max(sorted(rs, key=lambda r: float(r["rate"])), key=lambda r: _f(r.get(KEY)))
            for p, rs in pols.items()
        }
        ref = "smetric" if "smetric" in peaks else None
        ref_rate = float(peaks[ref]["rate"]) if ref else None
        entry: dict = {"policies": {}}
        for p, rs in pols.items():
            e = {"peak": _pick(peaks[p])}
            if ref_rate is not None:
                near = min(rs, key=lambda r: (abs(math.log(float(r["rate"]) / ref_rate)), float(r["rate"])))
                e["at_smetric_peak_rate"] = _pick(near)
            entry["policies"][p] = e
        fam = {p: _f(r.get(KEY)) for p, r in peaks.items() if is_smetric(p)}
        base = {p: _f(r.get(KEY)) for p, r in peaks.items() if not is_smetric(p)}
        if base:
            bb = max(base, key=lambda p: base[p])
            entry["best_baseline"] = bb
            if "smetric" in fam and base[bb] > 0:
                entry["smetric_vs_best_baseline"] = fam["smetric"] / base[bb]
            if fam and base[bb] > 0:
                bf = max(fam, key=lambda p: fam[p])
                entry["best_smetric"] = bf
                entry["best_smetric_vs_best_baseline"] = fam[bf] / base[bb]
        out[setting] = entry
    return out


def _cell(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def colocation_markdown(summary: dict) -> str:
    """One table per setting, policies by peak TPS within SLO."""
    lines: list[str] = []
    for setting, e in summary.items():
        lines.append(f"### {setting}\n")
        r = e.get("smetric_vs_best_baseline")
        if r is not None:
            lines.append(f"smetric / best baseline ({e['best_baseline']}): {r:.3f}\n")
        lines.append(
            "| policy | peak TPS within SLO | at rate | attainment (both) | TTFT p50 s | TTFT p99 s "
            "| TPOT p50 ms | TPOT p90 ms | >2x TTFT SLO | >2x TPOT SLO | at SMetric's peak rate: TPS, TTFT p50, TPOT p90 ms |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        pols = sorted(e["policies"].items(), key=lambda kv: -_f(kv[1]["peak"].get(KEY)))
        for p, v in pols:
            pk = v["peak"]
            at = v.get("at_smetric_peak_rate") or {}
            tp90 = at.get("tpot_p90")
            lines.append(
                f"| {p} | {_cell(pk.get(KEY), ',.0f')} | {pk['rate']:g} | {_cell(pk.get('slo_attainment_both'), '.3f')} "
                f"| {_cell(pk.get('ttft_p50'), '.2f')} | {_cell(pk.get('ttft_p99'), '.1f')} "
                f"| {_cell(_f(pk.get('tpot_p50')) * 1e3, '.1f')} | {_cell(_f(pk.get('tpot_p90')) * 1e3, '.1f')} "
                f"| {_cell(pk.get('over_2x_slo'), '.3f')} | {_cell(pk.get('over_2x_tpot'), '.3f')} "
                f"| {_cell(at.get(KEY), ',.0f')}, {_cell(at.get('ttft_p50'), '.2f')}, "
                f"{_cell(_f(tp90) * 1e3 if tp90 is not None else None, '.1f')} |"
            )
        lines.append("")
    return "\n".join(lines)
