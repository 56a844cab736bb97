"""Synthetic traces in the project's two input formats, for tests and examples."""

from __future__ import annotations

import json
from pathlib import Path


def agentic_record(
    session: int,
    turn: int,
    ts: float,
    blocks: int,
    *,
    start_id: int = 1,
    t_in_session: float = 0.0,
    think: float = 0.0,
    output: int = 10,
    agent: str = "main",
    extra_tokens: int = 0,
    ranges: list | None = None,
) -> dict:
    return {
        "session_id": session,
        "agent": agent,
        "parent_agent": None,
        "turn": turn,
        "timestamp": ts,
        "t_in_session": t_in_session,
        "input_length": blocks * 64 + extra_tokens,
        "output_length": output,
        "n_blocks": blocks,
        "hash_id_ranges": ranges if ranges is not None else [[start_id, start_id + blocks - 1]],
        "think_time": think,
    }


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def linear_sessions(
    path: Path,
    sessions: int = 4,
    turns: int = 3,
    first_blocks: int = 20,
    growth: int = 4,
    gap: float = 10.0,
    think: float = 1.0,
) -> Path:
    """Sessions whose every turn appends ``growth`` blocks to the previous prompt."""
    recs = []
    for s in range(sessions):
        t0 = s * gap
        for k in range(turns):
            blocks = first_blocks + k * growth
            recs.append(
                agentic_record(
                    s, k + 1, t0 + k * 5.0, blocks, t_in_session=k * 5.0, think=think if k else 0.0
                )
            )
    recs.sort(key=lambda r: r["timestamp"])
    return write_jsonl(path, recs)
