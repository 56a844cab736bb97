"""`smetric trace-export PATH --out FILE`: write a trace in the Mooncake JSONL format.

One JSON object per request, in arrival order::

    {"timestamp": 0, "input_length": 104059, "output_length": 312, "hash_ids": [0, 1, ...],
     "session_id": "...", "turn": 1, "req_idx": 0, "inferred_session_id": "...",
     "inferred_parent_idx": -1, "inferred_turn": 1}

- ``timestamp``: milliseconds since the first request (integer);
- ``hash_ids``: chained prefix block ids of ``--block-size`` tokens (default 512, the
  Mooncake and aiperf convention; a multiple of the trace's block size): the id at
  position k stands for the whole prefix 0..k, so two requests share an id exactly when
  they share that prefix. Only full blocks the source trace knows are listed.
- session fields: ``session_id`` (one sequential chain of turns, as aiperf replays it: the
  source session, plus ``/<stream>`` for an agentic sub-agent stream), ``turn``, and the
  ``inferred_*`` fields this project's Mooncake loader reads (``inferred_parent_idx``: the
  ``req_idx`` of the predecessor in the same agent stream, -1 for a first turn); with
  ``--delays`` also ``delay`` (ms of think time after the predecessor's answer, as aiperf's
  multi-turn replay reads it).

The result replays with aiperf (``--custom-dataset-type mooncake_trace``) and reads back
with ``smetric sim --trace FILE``. A ``.gz`` output name writes gzip.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import orjson

from stack.traces.load import load_trace
from stack.traces.model import Trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("path", help="trace file (agentic or Mooncake JSONL, .gz ok)")
    p.add_argument(
        "--format", default="auto", choices=["auto", "agentic", "mooncake"], help="input trace format"
    )
    p.add_argument("--out", required=True, help="output JSONL file ('.gz' = gzip, '-' = stdout)")
    p.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="tokens per hash id (a multiple of the trace's block size)",
    )
    p.add_argument("--delays", action="store_true", help="add 'delay' (ms think time) to follow-up turns")


def export_records(trace: Trace, block_size: int = 512, delays: bool = False):
    """Yield the Mooncake records of ``trace``, in arrival order."""
    if block_size <= 0 or block_size % trace.block_size:
        raise ValueError(
            f"--block-size must be a positive multiple of the trace's block size ({trace.block_size})"
        )
    k = block_size // trace.block_size
    ids: dict[tuple[int, int], int] = {}
    order = sorted(trace.requests, key=lambda r: (r.timestamp, r.idx))
    t0 = order[0].timestamp if order else 0.0
    out_idx: dict[int, int] = {}
    labels = trace.session_labels or list(range(len(trace.sessions)))
    for n, r in enumerate(order):
        out_idx[r.idx] = n
        hids: list[int] = []
        full = r.n_blocks // k  # whole output blocks
        for owner, start, end in r.path:
            # output block j covers source blocks [j*k, (j+1)*k); its id names the prefix
            # up to its last source block, which lies in the run holding block (j+1)*k - 1
            j0 = max(start, 0) // k
            for j in range(j0, full):
                last = (j + 1) * k - 1
                if last < start:
                    continue
                if last >= end:
                    break
                key = (owner, last)
                h = ids.get(key)
                if h is None:
                    h = ids[key] = len(ids)
                hids.append(h)
        sid = labels[r.session]
        sid = sid if isinstance(sid, (int, str)) else str(sid)
        if trace.fmt == "agentic" and r.stream:
            sid_stream = f"{sid}/{r.stream}"
        else:
            sid_stream = sid
        rec = {
            "timestamp": int(round((r.timestamp - t0) * 1000)),
            "input_length": r.input_len,
            "output_length": r.output_len,
            "hash_ids": hids,
            "session_id": sid_stream,
            "turn": r.turn,
            "req_idx": n,
            "inferred_session_id": sid,
            "inferred_parent_idx": out_idx.get(r.prev, -1) if r.prev >= 0 else -1,
            "inferred_turn": r.turn,
        }
        if delays and r.prev >= 0:
            rec["delay"] = int(round(r.think * 1000))
        yield rec


def run(args: argparse.Namespace) -> int:
    trace = load_trace(args.path, fmt=args.format)
    recs = export_records(trace, args.block_size, args.delays)
    first = next(recs, None)  # validates the block size before creating the file
    if args.out == "-":
        fh = sys.stdout.buffer
        close = False
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fh = gzip.open(out, "wb", compresslevel=6) if out.name.endswith(".gz") else out.open("wb")
        close = True
    n = 0
    try:
        for rec in [first] if first else []:
            fh.write(orjson.dumps(rec) + b"\n")
            n += 1
        for rec in recs:
            fh.write(orjson.dumps(rec) + b"\n")
            n += 1
    finally:
        if close:
            fh.close()
    if args.out != "-":
        print(f"wrote {n} requests to {args.out}", file=sys.stderr)
    return 0
