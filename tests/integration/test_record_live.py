"""router.record through the router: what it serves becomes a trace the simulator reads, one
conversation one inferred session, and the recording does not change the answers (issue 50)."""

from __future__ import annotations

import orjson
import pytest

from stack.models.tiny import build_tiny_model
from stack.traces.load import load_trace
from support.router_harness import Cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _chat(messages: list[dict], stream: bool = False) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": stream}


def test_a_conversation_is_recorded_as_one_session(model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("SMETRIC_TEST_ADMIN_TOKEN", "x")
    monkeypatch.setenv("SMETRIC_RECORD_SALT", "test-salt")
    rec_dir = tmp_path / "rec"
    c = Cluster(model_dir, router={"record": {"enabled": True, "dir": str(rec_dir)}, "replica_id": "r1"})
    try:
        history = [{"role": "user", "content": "first question about the garden " * 40}]
        for turn in range(3):
            r = c.client.post("/v1/chat/completions", json=_chat(history, stream=turn == 1))
            assert r.status_code == 200, r.text
            history += [
                {"role": "assistant", "content": f"answer {turn} " * 30},
                {"role": "user", "content": f"follow-up {turn} about the roses " * 30},
            ]
        other = [{"role": "user", "content": "an unrelated conversation about boats " * 40}]
        assert c.client.post("/v1/chat/completions", json=_chat(other)).status_code == 200
        bad = c.client.post("/v1/chat/completions", json={"model": "tiny", "messages": "no"})
        assert bad.status_code == 400  # refused before it was admitted: not recorded
    finally:
        c.close()  # the router's shutdown writes what is queued
    (path,) = rec_dir.glob("record-r1-*.jsonl")
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 4
    turns = lines[:3]
    assert {x["inferred_session_id"] for x in turns} == {"r1:0"}
    assert [x["inferred_turn"] for x in turns] == [1, 2, 3]
    assert [x["inferred_parent_idx"] for x in turns] == [-1, "r1:0", "r1:1"]
    assert lines[3]["inferred_session_id"] == "r1:1" and lines[3]["inferred_turn"] == 1
    for x in lines:
        assert x["status"] == 200 and x["outcome"] == "ok" and x["endpoint"] == "chat"
        assert x["prefill"].startswith("http://") and x["decode"].startswith("http://")
        assert x["input_length"] >= 64 and len(x["hash_ids"]) == x["input_length"] // 64
        assert x["ttft_ms"] is not None and x["completion"] >= x["timestamp"] + x["ttft_ms"]
    assert turns[1]["stream"] is True and turns[1]["output_from"] == "chunks"
    assert turns[0]["output_from"] == "usage" and turns[0]["output_length"] > 0
    assert turns[1]["hash_ids"][: len(turns[0]["hash_ids"])] == turns[0]["hash_ids"]
    text = path.read_text()
    assert "garden" not in text and "roses" not in text  # no content
    trace = load_trace(path)  # the simulator's loader reads it
    assert len(trace.requests) == 4 and len(trace.sessions) == 2 and trace.block_size == 64
    assert trace.requests[1].prev == 0 and trace.requests[2].prev == 1
