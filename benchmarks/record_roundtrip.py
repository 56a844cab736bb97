"""How faithfully a recording (``router.record``) keeps a trace: a shipped trace served request
by request through the recorder (its prompts as the router's chained block hashes), read back
by the simulator's loader, and the two compared: requests, prefix reuse (``smetric
trace-stats``'s ideal reuse ratio), and how often the recorder's inferred parent is the
trace's true predecessor in its agent stream.

    python benchmarks/record_roundtrip.py [--trace agentic_slice]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from stack.commands.trace_stats import reuse_stats
from stack.config import RecordConfig
from stack.prefill_router.record import Recorder, Served
from stack.traces.load import load_trace
from stack.traces.shipped import shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="agentic_slice", help="a shipped trace's name (stack/data/)")
    args = ap.parse_args()
    src = load_trace(shipped(args.trace))
    bs = src.block_size
    order = sorted(src.requests, key=lambda r: (r.timestamp, r.idx))
    with tempfile.TemporaryDirectory() as d:
        cfg = RecordConfig(
            enabled=True, dir=d, block_tokens=bs, rotate_bytes=1 << 40, max_bytes=1 << 41, queue=1 << 30
        )
        rec = Recorder(cfg, "r0", page_size=bs)
        t0 = 1_700_000_000_000
        for r in order:
            keys = [hash((owner, k)) & (2**63 - 1) for owner, s, e in r.path for k in range(s, e)]
            keys = keys[: r.input_len // bs]  # the router hashes full blocks only
            s = Served(t0 + round(r.timestamp * 1000), "chat", r.input_len, keys, None, False)
            s.status, s.output_tokens, s.output_from = 200, r.output_len, "usage"
            rec.offer(s)
        rec.close(300)
        (path,) = Path(d).glob("record-*.jsonl")
        got = load_trace(path)
    a, b = reuse_stats(src)[0], reuse_stats(got)[0]
    right = first_right = firsts = 0
    for mine, r in zip(got.requests, order, strict=True):
        firsts += r.prev == -1
        if mine.prev == -1:
            right += r.prev == -1
            first_right += r.prev == -1
        else:
            right += order[mine.prev].idx == r.prev
    n = len(order)
    print(f"trace {args.trace}: {n} requests, {len(src.sessions)} sessions, {firsts} agent streams")
    print(f"recorded: {len(got.requests)} requests, {len(got.sessions)} inferred sessions")
    print(f"ideal reuse ratio: source {a['ideal_reuse_ratio']:.4f}, recording {b['ideal_reuse_ratio']:.4f}")
    print(
        f"parent inferred right: {right}/{n} ({right / n:.1%}); stream starts found: {first_right}/{firsts}"
    )


if __name__ == "__main__":
    main()
