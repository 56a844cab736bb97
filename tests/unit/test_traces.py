"""Trace loaders: both formats, sessions and streams, interning, malformed input."""

from __future__ import annotations

import gzip
import json

import pytest

from stack.kv_tier.prefix_cache import PrefixCache
from stack.paths import data_dir, default_trace
from stack.traces import SHIPPED, shipped
from stack.traces.load import TraceError, load_trace
from support.traces import agentic_record, write_jsonl


def test_shipped_slice_loads_with_high_reuse():
    t = load_trace(default_trace())
    assert t.fmt == "agentic" and t.block_size == 64
    assert len(t.sessions) == 60 and len(t.requests) == 3166
    c = PrefixCache(None)
    reused = total = 0
    for r in t.requests:
        reused += min(c.hit(r.path) * 64, r.input_len)
        total += r.input_len
        c.insert(r.path)
    assert 0.9 < reused / total < 0.99  # the agentic trace reuses ~96% ideally


def test_agentic_streams_turns_and_prefix_paths(tmp_path):
    recs = [
        agentic_record(7, 1, 0.0, 10),
        agentic_record(7, 2, 5.0, 12, t_in_session=5.0, think=2.0),
        agentic_record(7, 1, 6.0, 8, t_in_session=6.0, agent="main/agent_001", ranges=[[1, 3], [100, 104]]),
        agentic_record(9, 1, 7.0, 10),  # another session: ids are session-local
    ]
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", recs))
    assert [r.session for r in t.requests] == [0, 0, 0, 1]
    assert t.requests[1].prev == 0 and t.requests[1].think == 2.0
    assert t.requests[2].prev == -1 and t.requests[2].stream == 1
    c = PrefixCache(None)
    c.insert(t.requests[0].path)
    assert c.hit(t.requests[1].path) == 10  # turn 2 extends turn 1
    assert c.hit(t.requests[2].path) == 3  # sub-agent shares the first 3 blocks
    assert c.hit(t.requests[3].path) == 0  # same local ids, other session: no sharing


def test_mooncake_format_chained_hashes(tmp_path):
    recs = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3],
         "inferred_session_id": 0, "inferred_parent_idx": 0, "req_idx": 1},
        {"timestamp": 2000, "input_length": 1000, "output_length": 5, "hash_ids": [0, 9]},
    ]  # fmt: skip
    recs[0].update({"req_idx": 0, "inferred_session_id": 0, "inferred_parent_idx": -1})
    p = tmp_path / "m.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    t = load_trace(p)
    assert t.fmt == "mooncake" and t.block_size == 512 and t.has_global_clock
    assert t.requests[1].timestamp == 1.0 and t.requests[1].prev == 0
    assert len(t.sessions) == 2
    c = PrefixCache(None)
    c.insert(t.requests[0].path)
    assert c.hit(t.requests[1].path) == 3
    assert c.hit(t.requests[2].path) == 1  # shares block 0 (a system prompt) across sessions


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "invalid JSON"),
        ('{"session_id": 1, "hash_id_ranges": "x", "input_length": 5, "timestamp": 0}', "hash_id_ranges"),
        ('{"session_id": 1, "hash_id_ranges": [[1, 2]], "timestamp": 0}', "input_length"),
        ('{"session_id": 1, "hash_id_ranges": [[1, 2]], "input_length": -5, "timestamp": 0}', "input_length"),
        (
            '{"session_id": 1, "hash_id_ranges": [[1, 2]], "input_length": "big", "timestamp": 0}',
            "input_length",
        ),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, msg):
    good = json.dumps(agentic_record(1, 1, 0.0, 2))
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(p, fmt="agentic")
    assert f"{p}:2" in str(e.value) and msg in str(e.value)


def test_missing_empty_and_unknown(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(TraceError, match="empty"):
        load_trace(tmp_path / "e.jsonl")
    (tmp_path / "u.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(tmp_path / "u.jsonl")
    with pytest.raises(TraceError, match="directory"):
        load_trace(tmp_path)


def test_shared_prefix_option_shares_tools_and_system_blocks(tmp_path):
    a = agentic_record(1, 1, 0.0, 30)
    b = agentic_record(2, 1, 1.0, 30, start_id=1)
    for r, tools in ((a, 640), (b, 1280)):
        r["tool_tokens"], r["system_tokens"] = tools, 0
    p = write_jsonl(tmp_path / "s.jsonl", [a, b])
    plain = load_trace(p)
    c = PrefixCache(None)
    c.insert(plain.requests[0].path)
    assert c.hit(plain.requests[1].path) == 0
    shared = load_trace(p, shared_prefix=True)
    assert shared.n_shared == 1
    c = PrefixCache(None)
    c.insert(shared.requests[0].path)
    assert c.hit(shared.requests[1].path) == 10  # the shorter of the two shared prefixes


@pytest.mark.parametrize(
    ("name", "fmt", "requests", "sessions"),
    [
        ("claude_code_agentic", "agentic", 32142, 470),
        ("mooncake_conversation", "mooncake", 12031, 8072),
        ("mooncake_synthetic", "mooncake", 3993, 2657),
    ],
)
def test_shipped_traces_load_from_the_package(name, fmt, requests, sessions):
    path = shipped(name)
    assert path.parent == data_dir() and path.is_file()
    assert shipped(path.name) == path  # the file name works too
    t = load_trace(path)
    assert (t.fmt, len(t.requests), len(t.sessions)) == (fmt, requests, sessions)
    assert t.has_global_clock == (fmt == "mooncake")


def test_shipped_names_licenses_and_attribution():
    assert shipped("agentic_slice") == default_trace()
    with pytest.raises(KeyError, match="no shipped trace"):
        shipped("toolagent")
    readme = (data_dir() / "README.md").read_text()
    for file in SHIPPED.values():
        assert f"`{file}`" in readme
    for lic in ("LICENSE-kv-cache-tester", "LICENSE-Mooncake"):
        assert "Apache License" in (data_dir() / lic).read_text()
        assert f"`{lic}`" in readme
    for url in ("https://github.com/callanjfox/kv-cache-tester", "https://github.com/kvcache-ai/Mooncake"):
        assert url in readme


def test_agentic_short_is_its_documented_cut(tmp_path):
    """stack/data/agentic_short.jsonl.gz is stack/traces/cut.py's cut of the 470-session trace,
    byte for byte, with the defaults the data README names."""
    from stack.traces.cut import MAX_PROMPT_TOKENS, MAX_TURNS, _read, cut, write

    src = _read(shipped("claude_code_agentic"))
    rows = list(cut(src))
    out = tmp_path / "short.jsonl.gz"
    write(out, rows)
    assert out.read_bytes() == shipped("agentic_short").read_bytes()
    assert (MAX_TURNS, MAX_PROMPT_TOKENS) == (5, 100_000)
    assert len({r["session_id"] for r in rows}) == 317 and len(rows) == 1770
    assert max(int(r["turn"]) for r in rows) <= 5 and max(int(r["input_length"]) for r in rows) <= 100_000
    kept = {r["session_id"] for r in rows}
    dropped = {r["session_id"] for r in src if int(r["turn"]) <= 5 and int(r["input_length"]) > 100_000}
    assert kept.isdisjoint(dropped)
    with pytest.raises(ValueError):
        list(cut(src, max_turns=0))
