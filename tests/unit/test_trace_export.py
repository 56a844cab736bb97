"""`smetric trace-export`: Mooncake JSONL with chained prefix ids that reads back."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from stack.commands.trace_stats import trace_stats
from stack.traces.load import load_trace


def smetric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def small(tmp_path):
    recs = [
        # session 7: turn 2 extends turn 1 (16 -> 24 blocks of 64 = 2 -> 3 blocks of 512)
        {"session_id": 7, "agent": "main", "turn": 1, "timestamp": 10.0, "t_in_session": 0.0, "input_length": 1024 + 5,
         "output_length": 3, "hash_id_ranges": [[0, 15]], "think_time": 0.0},
        {"session_id": 9, "agent": "main", "turn": 1, "timestamp": 11.0, "t_in_session": 0.0, "input_length": 1024,
         "output_length": 3, "hash_id_ranges": [[0, 15]], "think_time": 0.0},
        {"session_id": 7, "agent": "main", "turn": 2, "timestamp": 12.5, "t_in_session": 2.5, "input_length": 1536,
         "output_length": 3, "hash_id_ranges": [[0, 23]], "think_time": 2.0},
    ]  # fmt: skip
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def test_export_chained_ids_and_session_fields(small, tmp_path):
    out = tmp_path / "m.jsonl"
    r = smetric("trace-export", str(small), "--out", str(out), "--delays")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["timestamp"] for x in recs] == [0, 1000, 2500]
    a, b, c = recs
    assert len(a["hash_ids"]) == 2 and len(c["hash_ids"]) == 3
    assert c["hash_ids"][:2] == a["hash_ids"]  # the follow-up extends its predecessor
    assert not set(b["hash_ids"]) & set(a["hash_ids"])  # session-local ids: distinct sessions differ
    assert c["inferred_parent_idx"] == 0 and a["inferred_parent_idx"] == -1
    assert c["inferred_session_id"] == a["inferred_session_id"] == 7 and c["turn"] == 2
    assert c["delay"] == 2000 and "delay" not in a
    for k in ("timestamp", "input_length", "output_length", "hash_ids"):
        assert k in b


def test_roundtrip_through_the_mooncake_loader(tmp_path):
    from stack.paths import default_trace

    out = tmp_path / "slice.jsonl.gz"
    r = smetric("trace-export", str(default_trace()), "--out", str(out))
    assert r.returncode == 0, r.stderr
    with gzip.open(out, "rt") as fh:
        first = json.loads(fh.readline())
    assert first["timestamp"] == 0
    src = load_trace(default_trace())
    back = load_trace(out)
    assert back.fmt == "mooncake" and len(back.requests) == len(src.requests)
    assert len(back.sessions) == len(src.sessions)
    assert sum(1 for x in back.requests if x.prev >= 0) == sum(1 for x in src.requests if x.prev >= 0)
    s1, s2 = trace_stats(src, instances=4), trace_stats(back, instances=4)
    # 512-token blocks lose at most a block per request
    assert s2["ideal_reuse_ratio"] == pytest.approx(s1["ideal_reuse_ratio"], abs=0.01)


def test_bad_block_size_exit_2(small, tmp_path):
    r = smetric("trace-export", str(small), "--out", str(tmp_path / "x.jsonl"), "--block-size", "100")
    assert r.returncode == 2
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1 and "block-size" in r.stderr
    assert not (tmp_path / "x.jsonl").exists()
