"""PNG plots of a bench run (matplotlib, Agg backend): the counterparts of the paper's
Figures 11, 14, 15 and 21-23.

- ``tps_vs_rate.png``: prefill TPS within SLO against the offered rate, per policy (one
  panel per setting), with the clairvoyant upper bound as a dashed line.
- ``attainment_vs_rate.png``: SLO attainment against rate, with the 90% capacity line.
- ``ttft_cdf.png``: TTFT CDF of every policy at SMetric's peak rate (main setting).
- ``imbalance_cdf.png``: CDF of the per-window max/mean load imbalance, same runs.
- ``reuse_split.png``: prompt tokens reused from the local tier / fetched from the global
  tier / computed, per policy at SMetric's peak rate.
- ``tail_tradeoff.png``: prefill TPS within SLO against TTFT p99 and against the shares of
  requests over 2x / 5x their SLO, per policy (+ dispatch order), main setting.
- ``peak_by_setting.png`` (experiments with several settings): peak TPS per policy and
  setting.
"""

from __future__ import annotations

from pathlib import Path

from stack.bench.summary import row_label
from stack.policies import is_smetric


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_SM_COLORS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#9467bd", "#f7b6d2", "#c49c94"]
_BASE_COLORS = [
    "#1f77b4",
    "#2ca02c",
    "#17becf",
    "#7f7f7f",
    "#aec7e8",
    "#98df8a",
    "#393b79",
    "#637939",
    "#000000",
]
_SM_ORDER = [
    "smetric",
    "smetric-global",
    "smetric-b",
    "smetric-global-b",
    "smetric-basic",
    "smetric-load",
    "smetric-tokens",
]
_BASE_ORDER = [
    "lmetric",
    "least-load",
    "dynamo",
    "linear",
    "preble",
    "session",
    "slo-predictor",
    "round-robin",
]


_DISPATCH_LS = ("-", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def _style(label: str) -> dict:
    """Colour by policy, line style by dispatch order (``policy+order`` labels)."""
    policy, _, dispatch = label.partition("+")
    st = _policy_style(policy)
    if dispatch:
        st["ls"] = _DISPATCH_LS[1 + sum(map(ord, dispatch)) % (len(_DISPATCH_LS) - 1)]
    return st


def _policy_style(policy: str) -> dict:
    if is_smetric(policy):
        k = _SM_ORDER.index(policy) if policy in _SM_ORDER else len(_SM_ORDER)
        st = {"lw": 2.4 if policy == "smetric" else 1.6, "ls": "-", "marker": "o", "ms": 3}
        st["color"] = _SM_COLORS[k % len(_SM_COLORS)]
        return st
    k = _BASE_ORDER.index(policy) if policy in _BASE_ORDER else len(_BASE_ORDER)
    return {"lw": 1.2, "ls": "--", "marker": ".", "ms": 4, "color": _BASE_COLORS[k % len(_BASE_COLORS)]}


def _policies(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row_label(r) for r in rows))


def plot_all(out: Path, rows: list[dict], summary: dict, curves: dict, title: str = "") -> list[Path]:
    """Write the PNGs; ``curves[(setting, policy, rate)] = (ttft_quantiles, imbalance_quantiles)``."""
    plt = _plt()
    written: list[Path] = []
    settings = list(summary.get("settings", {}))
    if not settings:
        return written
    unit = str(rows[0].get("rate_unit", "")) if rows else ""
    written += _rate_panels(plt, out, rows, summary, settings, unit, title)
    main = summary.get("main_setting", settings[0])
    written += _cdfs(plt, out, summary, curves, main, title)
    written.append(_reuse_split(plt, out, rows, summary, main, title))
    p = _tail_tradeoff(plt, out, [r for r in rows if str(r["setting"]) == main], title, main)
    if p is not None:
        written.append(p)
    if len(settings) > 1:
        written.append(_peak_by_setting(plt, out, summary, settings, title))
    return written


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate_panels(
    plt, out: Path, rows: list[dict], summary: dict, settings: list[str], unit: str, title: str
) -> list[Path]:
    """``tps_vs_rate.png`` and ``attainment_vs_rate.png``: one panel per setting."""
    written = []
    for metric, fname, ylabel in (
        ("prefill_tps_within_slo", "tps_vs_rate.png", "prefill TPS within SLO (k tok/s)"),
        ("slo_attainment", "attainment_vs_rate.png", "SLO attainment"),
    ):
        n = len(settings)
        ncol = min(3, n)
        nrow = (n + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.8 * nrow), squeeze=False)
        for k, s in enumerate(settings):
            ax = axes[k // ncol][k % ncol]
            srows = [r for r in rows if str(r["setting"]) == s]
            for p in _policies(srows):
                pr = sorted((r for r in srows if row_label(r) == p), key=lambda r: float(r["rate"]))
                xs = [float(r["rate"]) for r in pr]
                ys = [float(r.get(metric) or 0.0) for r in pr]
                if metric.startswith("prefill"):
                    ys = [y / 1e3 for y in ys]
                ax.plot(xs, ys, label=p, **_style(p))
            if metric.startswith("prefill"):
                ub = summary["settings"][s].get("upper_bound")
                if ub and ub.get("prefill_tps"):
                    ax.axhline(ub["prefill_tps"] / 1e3, color="k", ls=":", lw=1, label="clairvoyant bound")
                    w = ub.get("prefill_tps_within_slo")
                    if w is not None and w < 0.99 * ub["prefill_tps"]:
                        ax.axhline(w / 1e3, color="grey", ls=":", lw=1, label="bound within SLO")
            else:
                ax.axhline(0.9, color="k", ls=":", lw=1)
                ax.set_ylim(-0.02, 1.02)
            ax.set_title(s if n > 1 else (title or s), fontsize=9)
            ax.set_xlabel(f"rate ({unit})")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        for k in range(n, nrow * ncol):
            axes[k // ncol][k % ncol].axis("off")
        axes[0][0].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        written.append(_save(plt, fig, out / fname))
    return written


def _cdfs(plt, out: Path, summary: dict, curves: dict, main: str, title: str) -> list[Path]:
    """``ttft_cdf.png`` and ``imbalance_cdf.png``: every policy at SMetric's peak rate."""
    ms = summary["settings"][main]
    ref = ms.get("smetric_peak_rate")
    pol = ms["policies"]

    def nearest_curve(policy: str, which: int):
        if ref is None:
            return None
        at = pol[policy].get("at_smetric_peak_rate", {}).get("rate")
        c = curves.get((main, policy, at))
        return c[which] if c else None

    written = []
    for which, fname, xlabel in (
        (0, "ttft_cdf.png", "TTFT (s)"),
        (1, "imbalance_cdf.png", "max/mean load per 30 s window"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        any_curve = False
        for p in pol:
            q = nearest_curve(p, which)
            if not q:
                continue
            ys = [k / (len(q) - 1) for k in range(len(q))]
            ax.plot(q, ys, label=p, **{k: v for k, v in _style(p).items() if k != "marker"})
            any_curve = True
        if which == 0 and any_curve:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("CDF")
        ax.set_title(f"{title} {main}: at SMetric's peak rate {ref:g}" if ref else title, fontsize=9)
        ax.grid(alpha=0.3)
        if any_curve:
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(plt, fig, out / fname))
    return written


def _reuse_split(plt, out: Path, rows: list[dict], summary: dict, main: str, title: str) -> Path:
    """``reuse_split.png``: local / global / computed prompt tokens at SMetric's peak rate."""
    ms = summary["settings"][main]
    ref = ms.get("smetric_peak_rate")
    pol = ms["policies"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(pol) + 2), 4.2))
    names = list(pol)
    loc, glo, miss = [], [], []
    for p in names:
        r = None
        if ref is not None:
            at = pol[p].get("at_smetric_peak_rate", {}).get("rate")
            r = next(
                (
                    x
                    for x in rows
                    if str(x["setting"]) == main and row_label(x) == p and float(x["rate"]) == at
                ),
                None,
            )
        if r is None:
            r = pol[p]["at_peak"]
        lo = float(r.get("reuse_local") or 0.0)
        gl = float(r.get("reuse_global") or 0.0)
        loc.append(lo)
        glo.append(gl)
        miss.append(max(0.0, 1.0 - lo - gl))
    xs = range(len(names))
    ax.bar(xs, loc, label="local tier", color="#2ca02c")
    ax.bar(xs, glo, bottom=loc, label="global tier", color="#1f77b4")
    ax.bar(xs, miss, bottom=[a + b for a, b in zip(loc, glo)], label="computed (miss)", color="#bbbbbb")
    ub = ms.get("upper_bound")
    if ub and ub.get("ideal_reuse") is not None:
        ax.axhline(ub["ideal_reuse"], color="k", ls=":", lw=1, label="ideal reuse")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title(f"{title} {main}: reuse split at rate {ref:g}" if ref else title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(plt, fig, out / "reuse_split.png")


def _peak_by_setting(plt, out: Path, summary: dict, settings: list[str], title: str) -> Path:
    """``peak_by_setting.png``: peak TPS within SLO per policy and setting."""
    names = list(dict.fromkeys(p for s in settings for p in summary["settings"][s]["policies"]))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(settings) + 3) + 1.5, 4.4))
    w = 0.8 / max(1, len(names))
    for j, p in enumerate(names):
        color = _style(p)["color"]
        ys = [
            summary["settings"][s]["policies"].get(p, {}).get("peak_prefill_tps_within_slo", 0.0) / 1e3
            for s in settings
        ]
        ax.bar([i + j * w for i in range(len(settings))], ys, width=w, label=p, color=color)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(settings))])
    ax.set_xticklabels(settings, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("peak prefill TPS within SLO (k tok/s)")
    ax.set_title(title, fontsize=9)
    # outside the axes: inside, it covers the last setting's bars
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(plt, fig, out / "peak_by_setting.png")


def _tail_tradeoff(plt, out: Path, rows: list[dict], title: str, setting: str) -> Path | None:
    """``tail_tradeoff.png``: TPS within SLO against P99 TTFT and against the shares of
    requests over 2x / 5x their SLO, one line per policy (+ dispatch order) over its rates:
    a gain bought by starving requests moves a line right, not just up."""
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15.0, 4.2), squeeze=False)
    for ax, key, xlabel in zip(
        axes[0],
        ("ttft_p99", "over_2x_slo", "over_5x_slo"),
        ("TTFT p99 (s)", "share of requests over 2x their SLO", "share over 5x their SLO"),
    ):
        for p in _policies(rows):
            pr = sorted((r for r in rows if row_label(r) == p), key=lambda r: float(r["rate"]))
            pts = [
                (float(r[key]), float(r.get("prefill_tps_within_slo") or 0.0) / 1e3)
                for r in pr
                if isinstance(r.get(key), (int, float))
            ]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, **_style(p))
        if key == "ttft_p99":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("prefill TPS within SLO (k tok/s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{title} {setting}: throughput within SLO against the tail (each point a rate)", fontsize=9)
    fig.tight_layout()
    return _save(plt, fig, out / "tail_tradeoff.png")
