"""The replay request builder reproduces a trace's block structure, and the replay metrics
use the simulator's definitions (SLO scaled by the time factor). No network."""

from __future__ import annotations

import pytest

from stack.core.types import SLO
from stack.models.tiny import build_tiny_model
from stack.paths import default_trace
from stack.prefill_router.features import FeatureExtractor
from stack.replay.builder import Conversations, Vocab, read_block_ids
from stack.replay.metrics import LoadSampler, Outcome, decisions, parse_prometheus, summarize
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _build_stream(conv, trace, idxs, copy=0):
    built = {}
    out = []
    for i in idxs:
        r = trace.requests[i]
        prev = built.get(r.prev) if r.prev >= 0 else None
        pout = trace.requests[r.prev].output_len if r.prev >= 0 else 0
        b = conv.build(copy, i, prev, r.prev, pout)
        built[i] = b
        out.append((r, b))
    return out


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_vocab_words_are_single_tokens(tiny):
    from tokenizers import Tokenizer

    v = Vocab.from_tokenizer(tiny)
    assert v.exact and len(v.words) >= 16
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    conv = Conversations([[1, 2, 3]], "agentic", 64, v)
    text = conv.block_text(0, 1) + conv.block_text(0, 2)
    assert len(tok.encode("\n" + text).ids) == 129
    assert conv.block_text(0, 1) == conv.block_text(0, 1)
    assert conv.block_text(0, 1) != conv.block_text(1, 1)  # replayed copies do not share
    assert Vocab.builtin().words and not Vocab.builtin().exact


def test_built_prompts_share_what_the_trace_shares(tiny):
    path = default_trace()
    trace = load_trace(path)
    ids, fmt = read_block_ids(path)
    assert fmt == "agentic" and len(ids) == len(trace.requests)
    assert all(len(ids[r.idx]) == r.n_blocks for r in trace.requests)
    conv = Conversations(ids, fmt, 64, Vocab.from_tokenizer(tiny), len(trace.sessions))
    fx = FeatureExtractor(tiny, 64)
    stream = [i for i in trace.sessions[0] if trace.requests[i].stream == 0][:8]
    hashes = {}
    for r, b in _build_stream(conv, trace, stream):
        f = fx.chat({"messages": b.messages})
        hashes[r.idx] = f.hashes
        # exact lengths: the template adds a few tokens per message
        assert abs(f.prompt_tokens - r.input_len) <= 64 + 8 * len(b.messages), (
            r.idx,
            f.prompt_tokens,
            r.input_len,
        )
        if r.prev < 0:
            assert f.turn == 1 and b.fresh
            continue
        assert not b.fresh and f.turn == (len(b.messages) + 1) // 2
        shared = _lcp(hashes[r.prev], f.hashes)
        want = trace.requests[r.prev].n_blocks
        assert want - 1 <= shared <= want + 2, (r.idx, shared, want)
        # est_hit: the previous prompt plus the answer
        p = trace.requests[r.prev]
        assert abs(
            f.est_hit - (p.input_len + min(p.output_len, f.prompt_tokens - p.input_len))
        ) <= 64 + 8 * len(b.messages)


def test_compaction_starts_a_fresh_conversation(tmp_path, tiny):
    recs = [
        agentic_record(0, 1, 0.0, 40, start_id=1),
        agentic_record(0, 2, 5.0, 50, start_id=1, t_in_session=5.0, think=1.0),
        # compacted: keeps only the first 10 blocks, then new ones
        agentic_record(0, 3, 9.0, 20, t_in_session=9.0, think=1.0, ranges=[[1, 10], [900, 909]]),
        # another session with the same local ids must not share text
        agentic_record(1, 1, 1.0, 40, start_id=1),
    ]
    path = write_jsonl(tmp_path / "t.jsonl", recs)
    trace = load_trace(path)
    ids, fmt = read_block_ids(path)
    conv = Conversations(ids, fmt, 64, Vocab.from_tokenizer(tiny), len(trace.sessions))
    fx = FeatureExtractor(tiny, 64)
    s0 = _build_stream(conv, trace, trace.sessions[0])
    (_, b1), (_, b2), (_, b3) = s0
    assert b1.fresh and not b2.fresh and b3.fresh
    h1, h3 = (fx.chat({"messages": b.messages}).hashes for b in (b1, b3))
    assert _lcp(h1, h3) in (9, 10)  # the kept prefix is shared (block boundaries move by the template)
    other = conv.build(1, trace.sessions[1][0], None, -1, 0)
    assert _lcp(fx.chat({"messages": other.messages}).hashes, h1) == 0


def test_mooncake_format_block_ids(tmp_path):
    import json

    p = tmp_path / "m.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": t, "input_length": n * 512, "output_length": 4, "hash_ids": list(range(n))}
            )
            for t, n in ((0, 2), (10, 3))
        )
    )
    ids, fmt = read_block_ids(p)
    assert fmt == "mooncake" and ids == [[0, 1], [0, 1, 2]]
    conv = Conversations(ids, fmt, 512, Vocab.builtin(), n_sessions=2)
    # global hashes: the same id gives the same text across sessions, repeats of the trace differ
    assert conv.block_text(0, 1) == conv.block_text(1, 1) != conv.block_text(2, 1)


def test_summarize_scales_the_slo_by_the_time_factor():
    slo = SLO(b=1.0, a=0.0)
    tf = 0.05
    outs = [
        Outcome(
            0,
            0,
            1,
            10.0,
            0.5,
            1000,
            ttft_wall=0.04,
            cached=500,
            cached_local=400,
            cached_global=100,
            measured=True,
        ),
        Outcome(
            1,
            0,
            2,
            20.0,
            1.0,
            3000,
            ttft_wall=0.06,
            tpot_wall=0.001,
            cached=0,
            cached_local=0,
            cached_global=0,
            measured=True,
        ),
        Outcome(2, 0, 1, 1.0, 0.05, 7000, ttft_wall=0.01, measured=False),  # warm-up
        Outcome(3, 1, 1, 30.0, 1.5, 5000, error="timeout: x", measured=True),
    ]
    m = summarize(outs, slo=slo, time_factor=tf, w_start=5.0, w_end=105.0, decisions_delta={"stick": 3.0})
    assert m["requests"] == 2 and m["errors"] == 1 and m["errors_measured"] == 1
    assert m["duration_s"] == pytest.approx(100.0)
    # 0.04 / 0.05 = 0.8 s <= 1 s met; 0.06 / 0.05 = 1.2 s missed
    assert m["prefill_tps_within_slo"] == pytest.approx(10.0)
    assert m["prefill_tps"] == pytest.approx(40.0)
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["ttft_p50"] == pytest.approx(1.0)
    assert m["tpot_p50"] == pytest.approx(0.02)
    assert m["reuse_total"] == pytest.approx(0.125) and m["reuse_local"] == pytest.approx(0.1)
    assert m["sticks"] == 3 and m["migrations"] is None
    assert m["error_kinds"] == {"timeout": 1}


def test_prometheus_parsing_and_imbalance():
    text = (
        "# HELP smetric_decisions_total routing decisions\n"
        'smetric_decisions_total{kind="stick",policy="smetric"} 7.0\n'
        'smetric_decisions_total{kind="first_turn",policy="smetric"} 2.0\n'
        'smetric_worker_inflight{role="prefill",worker="http://a"} 3.0\n'
        'smetric_worker_inflight{role="decode",worker="http://d"} 9.0\n'
    )
    s = parse_prometheus(text)
    assert decisions(s) == {"stick": 7.0, "first_turn": 2.0}
    ls = LoadSampler(30.0)
    ls.add(1.0, {"a": 3.0, "b": 1.0})
    ls.add(2.0, {"a": 1.0, "b": 1.0})
    ls.add(40.0, {"a": 0.0, "b": 0.0})
    assert ls.imbalance(0.0, 60.0) == [pytest.approx(2.0 / 1.5)]
