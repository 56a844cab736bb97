"""``smetric compare``'s outputs: compare.csv (one row per configuration), compare.png
(prefill TPS within SLO and TTFT, live next to sim) and the printed table."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from stack.bench.live import fmt_cell

CSV_KEYS = [
    "config",
    "router",
    "policy",
    "sim_policy",
    "runs",
    "live_prefill_tps_within_slo",
    "live_prefill_tps_within_slo_spread",
    "sim_prefill_tps_within_slo",
    "gap_tps_within_slo",
    "live_slo_attainment",
    "sim_slo_attainment",
    "live_ttft_p50",
    "sim_ttft_p50",
    "gap_ttft_p50",
    "live_ttft_p90",
    "sim_ttft_p90",
    "live_reuse_total",
    "sim_reuse_total",
    "live_reuse_local",
    "sim_reuse_local",
    "live_requests",
    "sim_requests",
    "live_requests_sent",
    "live_errors_max",
    "live_lost_max",
    "loadavg_1m_max",
]


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_KEYS})


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    x = list(range(len(rows)))
    w = 0.38
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(rows) + 4), 4.8))
    panels = (
        ("prefill_tps_within_slo", "prefill TPS within SLO (tokens/s)"),
        ("ttft_p50", "TTFT p50 (bars) / p90 (ticks), modelled s, log scale"),
    )
    for ax, (key, label) in zip(axes, panels, strict=True):
        live = [r.get(f"live_{key}") or 0.0 for r in rows]
        sim = [r.get(f"sim_{key}") or 0.0 for r in rows]
        err = [r.get(f"live_{key}_spread") or 0.0 for r in rows]
        colors = ["tab:blue" if r["router"] == "smetric router" else "tab:orange" for r in rows]
        ax.bar([i - w / 2 for i in x], live, w, color=colors, yerr=[e / 2 for e in err], label="live")
        ax.bar([i + w / 2 for i in x], sim, w, color="lightgray", edgecolor="gray", label="sim")
        if key == "ttft_p50":
            for dx, side, color in ((-w / 2, "live", "black"), (w / 2, "sim", "dimgray")):
                ax.scatter(
                    [i + dx for i in x],
                    [r.get(f"{side}_ttft_p90") or 0 for r in rows],
                    marker="_",
                    s=200,
                    color=color,
                    label=f"{side} p90",
                    zorder=3,
                )
            ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="tab:blue", label="live, smetric router"),
        Patch(color="tab:orange", label="live, sglang-router"),
        Patch(facecolor="lightgray", edgecolor="gray", label="sim (same load)"),
    ]
    axes[0].legend(handles=handles, fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], title: str, order: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=230)
    t = Table(title=title)
    cols = [
        ("config", "config", "{}"),
        ("sim_policy", "sim\ncounterpart", "{}"),
        ("live_prefill_tps_within_slo", "live: TPS\nwithin SLO", "{:,.0f}"),
        ("live_prefill_tps_within_slo_spread", "±spread", "{:,.0f}"),
        ("sim_prefill_tps_within_slo", "sim: TPS\nwithin SLO", "{:,.0f}"),
        ("gap_tps_within_slo", "gap\nlive/sim", "{:+.0%}"),
        ("live_slo_attainment", "live\nSLO att.", "{:.0%}"),
        ("sim_slo_attainment", "sim\nSLO att.", "{:.0%}"),
        ("live_ttft_p50", "live TTFT\np50 (s)", "{:.2f}"),
        ("sim_ttft_p50", "sim TTFT\np50 (s)", "{:.2f}"),
        ("live_ttft_p90", "live TTFT\np90 (s)", "{:.2f}"),
        ("sim_ttft_p90", "sim TTFT\np90 (s)", "{:.2f}"),
        ("live_reuse_total", "live\nreuse", "{:.0%}"),
        ("sim_reuse_total", "sim\nreuse", "{:.0%}"),
        ("live_requests", "live\nrequests", "{:.0f}"),
        ("live_lost_max", "lost", "{}"),
        ("loadavg_1m_max", "load\n1m", "{:.1f}"),
    ]
    for _k, head, _f in cols:
        t.add_column(
            head, justify="left" if _k in ("config", "sim_policy") else "right", no_wrap=_k == "config"
        )
    for r in rows:
        t.add_row(*[fmt_cell(r.get(k), f) for k, _h, f in cols])
    console.print(t)
    if order is not None:
        console.print(
            f"ordering by prefill TPS within SLO: live {' > '.join(order['live_order'])}\n"
            f"                                    sim  {' > '.join(order['sim_order'])}\n"
            f"pairwise agreement {fmt_cell(order['agreement'], '{:.0%}')}; discordant pairs beyond noise: "
            f"{order['discordant_beyond_noise']}, within noise: {order['discordant_within_noise']}"
        )
    console.print(
        "TTFTs and TPS in modelled seconds (wall / time factor); sim counterparts of sglang-router's "
        "policies are approximations (compare.json: sim_note)."
    )
