"""Cut an agentic trace down to short sessions: the main job's workload.

    python -m stack.traces.cut stack/data/claude_code_agentic.jsonl.gz OUT.jsonl.gz \\
        --max-turns 5 --max-prompt-tokens 100000

Keeps, of every session, the first ``max_turns`` turns of each agent stream (the ``turn``
field counts per stream), and only the sessions whose kept turns all have prompts of at most
``max_prompt_tokens`` tokens; every kept request is written unchanged, in the source order.
``stack/data/agentic_short.jsonl.gz`` is this cut of the 470-session trace with the defaults
above (docs/research/fidelity.md says why: many short sessions make a run's figure depend far less on
which sessions it happens to draw than the long sessions of the full trace do).
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

MAX_TURNS = 5
MAX_PROMPT_TOKENS = 100_000


def cut(
    rows: Iterable[dict], max_turns: int = MAX_TURNS, max_prompt_tokens: int = MAX_PROMPT_TOKENS
) -> Iterator[dict]:
    """The rows of the cut, in the order given (see the module docstring)."""
    if max_turns < 1 or max_prompt_tokens < 1:
        raise ValueError("max_turns and max_prompt_tokens must be >= 1")
    kept = [r for r in rows if int(r["turn"]) <= max_turns]
    too_long = {r["session_id"] for r in kept if int(r["input_length"]) > max_prompt_tokens}
    return (r for r in kept if r["session_id"] not in too_long)


def _read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        return [orjson.loads(line) for line in fh if line.strip()]


def write(path: Path, rows: Iterable[dict]) -> int:
    """Write ``rows`` as JSONL (gzip for a ``.gz`` name, with no timestamp in its header, so
    the same cut gives the same bytes); returns how many."""
    n = 0
    body = bytearray()
    for r in rows:
        body += orjson.dumps(r) + b"\n"
        n += 1
    if path.suffix == ".gz":
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as fh:
            fh.write(bytes(body))
    else:
        path.write_bytes(bytes(body))
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stack.traces.cut",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("source", type=Path, help="agentic JSONL trace (.gz ok)")
    ap.add_argument("out", type=Path, help="where to write the cut (.gz: gzip)")
    ap.add_argument("--max-turns", type=int, default=MAX_TURNS, help="turns kept of each agent stream")
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=MAX_PROMPT_TOKENS,
        help="a session with a longer prompt in its kept turns is dropped whole",
    )
    a = ap.parse_args(argv)
    rows = list(cut(_read(a.source), a.max_turns, a.max_prompt_tokens))
    n = write(a.out, rows)
    print(f"{a.out}: {n} requests, {len({r['session_id'] for r in rows})} sessions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
