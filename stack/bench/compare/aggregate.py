"""``smetric compare``'s rows: per configuration the live runs' mean (and spread, with
``--repeat``) beside the simulator's figure, and whether the simulator orders the
configurations as the live runs do."""

from __future__ import annotations

import math

METRICS = (
    "prefill_tps_within_slo",
    "slo_attainment",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "reuse_total",
    "reuse_local",
    "reuse_global",
    "prefill_tps",
    "imbalance_mean",
)
LIVE_COUNTS = ("requests", "requests_total", "requests_sent", "errors", "errors_measured", "lost", "wall_s")


def _num(v) -> float | None:
    return v if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _mean(xs: list) -> float | None:
    xs = [x for x in (_num(x) for x in xs) if x is not None]
    return sum(xs) / len(xs) if xs else None


def _spread(xs: list) -> float | None:
    xs = [x for x in (_num(x) for x in xs) if x is not None]
    return (max(xs) - min(xs)) if len(xs) >= 2 else None


def aggregate(runs: list[dict], sim: dict | None, counterpart: str | None, note: str) -> dict:
    r0 = runs[0]
    row: dict = {
        "config": f"{'ours' if r0['router'] == 'smetric router' else 'sglang-router'}:{r0['policy']}",
        "router": r0["router"],
        "policy": r0["policy"],
        "sim_policy": counterpart,
        "sim_note": note,
        "runs": len(runs),
    }
    for k in METRICS:
        row[f"live_{k}"] = _mean([r.get(k) for r in runs])
        if len(runs) > 1:
            row[f"live_{k}_spread"] = _spread([r.get(k) for r in runs])
        row[f"sim_{k}"] = _num(sim.get(k)) if sim else None
    for k in LIVE_COUNTS:
        row[f"live_{k}"] = _mean([r.get(k) for r in runs])
    row["live_errors_max"] = max(int(r.get("errors") or 0) for r in runs)
    row["live_lost_max"] = max(int(r.get("lost") or 0) for r in runs)
    row["sim_requests"] = sim.get("requests") if sim else None
    lt, st = row["live_prefill_tps_within_slo"], row["sim_prefill_tps_within_slo"]
    row["gap_tps_within_slo"] = (lt - st) / st if lt is not None and st else None
    lp, sp = row["live_ttft_p50"], row["sim_ttft_p50"]
    row["gap_ttft_p50"] = (lp - sp) / sp if lp is not None and sp else None
    row["loadavg_1m_max"] = max(max(r["loadavg_before"][0], r["loadavg_after"][0]) for r in runs)
    return row


def ordering(rows: list[dict], key: str = "prefill_tps_within_slo") -> dict:
    """Does the simulator order the configurations as the live runs do (higher is better)?

    Pairwise: a pair is concordant when live and sim agree on which is better; a discordant
    pair whose live difference is within the live run-to-run spread (the larger spread of the
    two, or 5% when there is one run) is noise, not a wrong prediction."""
    rs = [r for r in rows if r.get(f"live_{key}") is not None and r.get(f"sim_{key}") is not None]
    live = sorted(rs, key=lambda r: -r[f"live_{key}"])
    sim = sorted(rs, key=lambda r: -r[f"sim_{key}"])
    pairs = []
    conc = disc = 0
    for i in range(len(rs)):
        for j in range(i + 1, len(rs)):
            a, b = rs[i], rs[j]
            dl = a[f"live_{key}"] - b[f"live_{key}"]
            ds = a[f"sim_{key}"] - b[f"sim_{key}"]
            if dl * ds > 0 or (dl == 0 and ds == 0):
                conc += 1
                continue
            sp = [x for x in (a.get(f"live_{key}_spread"), b.get(f"live_{key}_spread")) if x is not None]
            noise = max(sp) if sp else 0.05 * max(abs(a[f"live_{key}"]), abs(b[f"live_{key}"]))
            within = abs(dl) <= noise
            if not within:
                disc += 1
            pairs.append(
                {
                    "a": a["config"],
                    "b": b["config"],
                    "live_diff": dl,
                    "sim_diff": ds,
                    "noise": noise,
                    "noise_basis": "run-to-run spread" if sp else "5% (single run)",
                    "within_noise": within,
                }
            )
    n = len(rs) * (len(rs) - 1) // 2
    return {
        "metric": key,
        "live_order": [r["config"] for r in live],
        "sim_order": [r["config"] for r in sim],
        "pairs": n,
        "concordant": conc,
        "discordant_beyond_noise": disc,
        "discordant_within_noise": len(pairs) - disc,
        "agreement": (n - disc) / n if n else None,  # pairs ordered alike or within noise
        "discordant": pairs,
    }
