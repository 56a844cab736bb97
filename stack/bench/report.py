"""Terminal tables (rich) and markdown tables of a bench summary."""

from __future__ import annotations


def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    if v is None:
        return none
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _x(v) -> str:
    return "-" if v is None else f"x{v:.3f}"


def table_rows(ss: dict) -> list[list[str]]:
    """One row per policy (sorted by peak) for one setting's summary."""
    out = []
    pols = sorted(ss["policies"].items(), key=lambda kv: -kv[1]["peak_prefill_tps_within_slo"])
    for name, p in pols:
        ap = p["at_peak"]
        sp = p.get("at_smetric_peak_rate") or {}
        out.append(
            [
                name,
                _fmt(p["peak_prefill_tps_within_slo"] / 1e3, ".1f"),
                _fmt(p["peak_rate"], ".4g"),
                _fmt(p["capacity"], ".4g"),
                _fmt(ap.get("slo_attainment"), ".3f"),
                f"{_fmt(sp.get('ttft_p50'))} / {_fmt(sp.get('ttft_p90'))} / {_fmt(sp.get('ttft_p99'), '.1f')}",
                f"{_pct(sp.get('over_2x_slo'))} / {_pct(sp.get('over_5x_slo'))}",
                f"{_fmt(ap.get('reuse_local'))} / {_fmt(ap.get('reuse_global'))}",
                f"{ap.get('sticks') or 0}/{ap.get('migrations') or 0}/{ap.get('first_turns') or 0}"
                f"/{ap.get('evicted_followups') or 0}",
                _fmt(ap.get("imbalance_mean")),
                _fmt(ap.get("gpu_utilization")),
                _fmt(100 * p["peak_vs_upper_bound"], ".0f") + "%" if p.get("peak_vs_upper_bound") else "-",
            ]
        )
    return out


HEADERS = [
    "policy",
    "peak TPS in SLO (k tok/s)",
    "at rate",
    "capacity",
    "attain. @peak",
    "TTFT p50/p90/p99 s @SM-peak",
    ">2x/>5x SLO @SM-peak",
    "reuse loc/glob @peak",
    "stick/migr/first/evicted @peak",
    "imbal. @peak",
    "GPU util @peak",
    "of bound",
]


def ratio_line(ss: dict) -> str:
    if ss.get("best_baseline") is None:
        # e.g. the hyper experiment: SMetric variants only, nothing to compare with
        parts = [f"best SMetric ({ss.get('best_smetric')}); no baseline in this run, so no ratios"]
    else:
        parts = [
            f"best SMetric ({ss.get('best_smetric')}) / best baseline ({ss.get('best_baseline')}): "
            f"peak {_x(ss.get('smetric_vs_best_baseline'))}, capacity {_x(ss.get('smetric_capacity_vs_best_baseline'))}",
            f"faithful smetric: peak {_x(ss.get('faithful_smetric_vs_best_baseline'))}, "
            f"capacity {_x(ss.get('faithful_smetric_capacity_vs_best_baseline'))}",
        ]
    if ss.get("smetric_ttft_p90_vs_best_baseline") is not None:
        parts.append(
            f"P90 TTFT at SMetric's peak rate vs best baseline {_x(ss.get('smetric_ttft_p90_vs_best_baseline'))}"
        )
    ub = ss.get("upper_bound")
    if ub:
        within = ub.get("prefill_tps_within_slo")
        parts.append(
            f"clairvoyant bound {ub['prefill_tps'] / 1e3:.0f}k tok/s (ideal reuse {ub['ideal_reuse']:.3f})"
            + (
                f", {within / 1e3:.0f}k within SLO ({100 * ub['feasible_token_share']:.0f}% of prompt tokens can meet it)"
                if within is not None
                else ""
            )
        )
    return "; ".join(parts)


def print_summary(summary: dict, rate_unit: str, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        import sys

        console = Console(width=None if sys.stdout.isatty() else 170)
    for label, ss in summary["settings"].items():
        t = Table(
            # escaped: rich would take "[slack=0]" for a markup tag and drop it
            title=escape(f"{summary.get('experiment', '')} [{label}]  rates in {rate_unit}"),
            title_justify="left",
        )
        for h in HEADERS:
            t.add_column(h, justify="left" if h == "policy" else "right", overflow="fold")
        for row in table_rows(ss):
            t.add_row(*row)
        console.print(t)
        console.print(escape(ratio_line(ss)))


def markdown(summary: dict) -> str:
    lines = []
    for label, ss in summary["settings"].items():
        lines.append(f"**{label}**\n")
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "---|" * len(HEADERS))
        for row in table_rows(ss):
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(ratio_line(ss))
        lines.append("")
    return "\n".join(lines)
