"""What ``smetric calibrate`` hands back: the calibration file, a summary table and a plot of
predicted against measured times."""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from stack.core.cost_model import CostModel, DecodeCost, Hardware, dump_hardware
from stack.core.fit import LinearFit

#: the keys a sweep never measures: they come from the base calibration (``--base``)
NOT_MEASURED = ("kv_bytes_per_token", "gpus_per_server", "nic_gbps", "link_efficiency", "expert_share")


def build_hardware(
    name: str,
    cost: CostModel,
    base: Hardware,
    decode: LinearFit | None,
    decode_tpot_s: float | None,
    chunk_tokens: int | None,
    hbm_kv_tokens: int | None,
    description: str,
) -> Hardware:
    """The calibration: the fitted terms, the engine's own budgets where it reported them,
    the rest from ``base``."""
    dec = base.decode
    if decode is not None:
        d_fwd, d_ctx = decode.coef
        dec = DecodeCost(d_fwd, 0.0, base.decode.expert_share, d_ctx)
    return replace(
        base,
        name=name,
        description=description,
        cost=cost,
        chunk_tokens=int(chunk_tokens or base.chunk_tokens),
        hbm_kv_tokens=int(hbm_kv_tokens or base.hbm_kv_tokens),
        decode_tpot_s=float(decode_tpot_s if decode_tpot_s is not None else base.decode_tpot_s),
        decode=dec,
    )


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def header(
    source: str, timing: str, prefill: LinearFit, decode: LinearFit | None, base: str, repeats: int | None
) -> str:
    """The comment block on top of the calibration file."""
    today = _dt.date.today().isoformat()
    reps = f" x {repeats} repeats" if repeats else ""
    lines = [
        f"Calibrated by `smetric calibrate` on {today} from {source}.",
        f"Prefill timings: {timing}.",
        "Prefill: cost(n, L) = c_linear*n + c_attn*n*(L - n/2) + c_fwd per forward"
        + (" + c_prefix*(L - n)^2/2" if "c_prefix" in prefill.names else "")
        + ", non-negative least",
        f"squares of the relative error over {prefill.n_train} points{reps}; held-out MAPE "
        f"{_pct(prefill.holdout_mape)} on {prefill.n_holdout} points (fit {_pct(prefill.train_mape)}).",
    ]
    if decode is not None:
        lines += [
            "Decode: step(1, C) = d_fwd + d_ctx*C at batch 1 (client-side, per streamed token); d_experts = 0",
            f"(batch 1 cannot separate it from d_fwd); held-out MAPE {_pct(decode.holdout_mape)} on "
            f"{decode.n_holdout} points (fit {_pct(decode.train_mape)}).",
        ]
    else:
        lines.append(f"Decode terms and decode_tpot_s: from {base} (not measured).")
    lines.append(f"Not measured, from {base}: {', '.join(NOT_MEASURED)}.")
    return "\n".join(lines)


def provenance(
    source: str, timing: str, prefill: LinearFit, decode: LinearFit | None, extra: dict | None = None
) -> dict:
    """The file's ``calibration`` section (``load_hardware`` ignores it)."""
    out = {
        "source": source,
        "date": _dt.date.today().isoformat(),
        "timing": timing,
        "prefill": {k: round_value(v) for k, v in prefill.as_dict().items()},
    }
    if decode is not None:
        out["decode"] = {k: round_value(v) for k, v in decode.as_dict().items()}
    if extra:
        out.update(extra)
    return {"calibration": out}


def round_value(v):
    if isinstance(v, float):
        return None if math.isnan(v) else float(f"{v:.6g}")
    return v


def write(path: str | Path, hw: Hardware, head: str, prov: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_hardware(hw, head, prov))
    return p


def summary(
    console: Console, hw: Hardware, prefill: LinearFit, decode: LinearFit | None, timing: str
) -> None:
    """The fitted terms and their errors, as a table."""
    t = Table(title=f"calibration {hw.name}", show_header=True)
    for col in ("term", "value", "fit MAPE", "held-out MAPE", "points (fit / held out)"):
        t.add_column(col)
    c = hw.cost
    pts = f"{prefill.n_train} / {prefill.n_holdout}"
    t.add_row(
        "c_linear (s/token)", f"{c.c_linear:.4g}", _pct(prefill.train_mape), _pct(prefill.holdout_mape), pts
    )
    t.add_row("c_attn (s/token^2)", f"{c.c_attn:.4g}", "", "", "")
    t.add_row("c_fwd (s/forward)", f"{c.c_fwd:.4g}", "", "", "")
    if "c_prefix" in prefill.names:
        t.add_row("c_prefix (s/token^2)", f"{c.c_prefix:.4g}", "", "", "")
    if decode is not None:
        d = hw.decode
        dpts = f"{decode.n_train} / {decode.n_holdout}"
        t.add_row(
            "d_fwd (s/step)", f"{d.d_fwd:.4g}", _pct(decode.train_mape), _pct(decode.holdout_mape), dpts
        )
        t.add_row("d_ctx (s/token/step)", f"{d.d_ctx:.4g}", "", "", "")
        t.add_row("decode_tpot_s", f"{hw.decode_tpot_s:.4g}", "", "", "")
    console.print(t)
    console.print(f"prefill timings: {timing}")


def plot(path: str | Path, prefill: LinearFit, decode: LinearFit | None, title: str) -> Path:
    """Predicted against measured seconds, fitted and held-out points apart, with the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prefill (s)", prefill)] + ([("decode step (s)", decode)] if decode is not None else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (label, fit) in zip(axes[0], panels):
        ms = [p.measured for p in fit.points]
        lo, hi = min(ms) * 0.7, max(ms) * 1.4
        ax.plot([lo, hi], [lo, hi], color="0.3", lw=1)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="+-15%")
        for hold, mark, name in ((False, "o", "fit"), (True, "s", "held out")):
            pts = [p for p in fit.points if p.holdout == hold]
            if pts:
                mape = fit.holdout_mape if hold else fit.train_mape
                ax.scatter(
                    [p.measured for p in pts],
                    [p.predicted for p in pts],
                    marker=mark,
                    label=f"{name} ({len(pts)}, MAPE {_pct(mape)})",
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
