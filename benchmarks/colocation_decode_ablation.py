"""Colocation: how much of SMetric's figure its decode-aware estimate makes.

    python benchmarks/colocation_decode_ablation.py --trace PATH --rate R [--policies smetric,smetric-global]

Runs each policy twice in the simulator's colocated mode (default cluster, one rate: sessions
per second, or the time compression of a Mooncake trace): with the TTFT estimate that adds
the decode work each forward carries (``DecodeAwareTTFT``, what colocated runs use) and
without it (the PD estimate, blind to the instance's decodes), and prints TPS within both
SLOs beside TTFT p50 / p99, TPOT p50 / p90 and the shares of requests past 2x their SLOs.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from stack.policies import PolicyContext, make_policy
from stack.sim.engine import Simulator
from stack.sim.options import SimOptions
from stack.traces import shipped

COLUMNS = (
    ("tps_within_slo", "TPS within SLO", "{:,.0f}"),
    ("slo_attainment_both", "attainment", "{:.3f}"),
    ("ttft_p50", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99", "TTFT p99 s", "{:.1f}"),
    ("tpot_p50", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p90", "TPOT p90 ms", "{:.1f}"),
    ("over_2x_slo", ">2x TTFT SLO", "{:.3f}"),
    ("over_2x_tpot", ">2x TPOT SLO", "{:.3f}"),
    ("decode_batch_mean", "decode batch", "{:.2f}"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace",
        default=str(shipped("claude_code_agentic")),
        help="trace file (default: the shipped 470-session agentic trace, stack/data/)",
    )
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--policies", default="smetric,smetric-global")
    args = ap.parse_args()
    opts = SimOptions(trace=args.trace, mode="colocated")
    trace = opts.read_trace()
    cfg = opts.sim_config()
    spec = opts.load_spec(trace, args.rate)
    table = Table(title=f"colocated, {args.trace.rsplit('/', 1)[-1]} at {args.rate:g}")
    table.add_column("policy")
    table.add_column("estimate")
    for _, head, _ in COLUMNS:
        table.add_column(head, justify="right")
    for name in args.policies.split(","):
        for aware in (True, False):
            ctx = PolicyContext(
                cost=cfg.hardware.cost,
                slo=cfg.slo,
                block_size=trace.block_size,
                colocated=aware,
                chunk_tokens=cfg.chunk_tokens or cfg.hardware.chunk_tokens,
            )
            m = Simulator(trace, make_policy(name, ctx), cfg, spec).run().metrics
            cells = []
            for key, _, fmt in COLUMNS:
                v = m[key] * (1e3 if key.startswith("tpot") else 1.0)
                cells.append(fmt.format(v))
            table.add_row(name, "decode-aware" if aware else "decode-blind", *cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
