"""router.record: block ids keyed with a salt, sessions inferred from prompts, files rotated and
capped, and a recording that reads back as the trace it was made from (issue 50)."""

from __future__ import annotations

import os
import stat

import orjson
import pytest

from stack.commands.trace_stats import reuse_stats
from stack.config import RecordConfig, parse_config
from stack.core.session_guess import SessionGuess
from stack.prefill_router.record import BlockIds, Recorder, Served, output_tokens_of
from stack.traces.load import load_trace
from stack.traces.shipped import shipped

pytestmark = pytest.mark.timeout(120)


def test_recording_is_off_by_default():
    assert parse_config({}).router.record.enabled is False
    with pytest.raises(ValueError, match="record"):
        parse_config({"router": {"record": {"enabled": True, "rotate": 5}}})


def test_block_ids_keep_prefixes_and_hide_the_hashes():
    ids = BlockIds(b"salt", page_size=16, block_tokens=64)
    a = ids(list(range(1, 17)))  # 16 pages of 16 tokens: 4 blocks of 64
    assert len(a) == 4 and a == ids(list(range(1, 17)))
    assert ids(list(range(1, 9))) == a[:2]  # a shared prefix, the same ids
    # chained hashes: a block's id is its last page's hash, which stands for the whole prefix
    other = ids([1, 2, 3, 4, 5, 6, 7, 99])
    assert other[0] == a[0] and other[1] != a[1]
    assert not set(a) & set(range(1, 17))
    assert all(0 <= x < 2**63 for x in a)
    assert BlockIds(b"other", 16, 64)(list(range(1, 17))) != a  # another deployment's salt
    with pytest.raises(ValueError, match="multiple"):
        BlockIds(b"s", page_size=48, block_tokens=64)


def test_sessions_follow_prompts_that_extend_the_previous_one():
    g = SessionGuess()
    assert g.place(0, [1, 2, 3]) == (0, 1, -1)
    assert g.place(1, [9, 8]) == (1, 1, -1)  # another conversation
    assert g.place(2, [1, 2, 3, 4, 5]) == (0, 2, 0)  # extends request 0
    assert g.place(3, [9, 8, 7]) == (1, 2, 1)
    assert g.place(4, [1, 2, 3, 4, 5, 6]) == (0, 3, 2)
    assert g.place(5, [1, 2, 3, 4, 5, 6]) == (0, 4, 4)  # a retry of the same prompt continues it
    assert g.place(6, []) == (2, 1, -1)  # no full block: a session of its own


def test_output_tokens_as_the_answer_states_them():
    assert output_tokens_of(b'{"usage":{"prompt_tokens":5,"completion_tokens":7}}') == 7
    assert output_tokens_of(b'{"usage":{"input_tokens":5,"output_tokens":3}}') == 3
    assert output_tokens_of(b'{"meta_info":{"completion_tokens": 2}}') == 2
    assert output_tokens_of(b'{"choices":[]}') is None


def _served(i: int, ids: list[int], t: int = 1_700_000_000_000) -> Served:
    return Served(
        t + i * 1000, "chat", len(ids) * 64, ids, None, False, status=200, end_ms=t + i * 1000 + 500
    )


def test_files_rotate_and_the_oldest_go_past_the_cap(tmp_path, monkeypatch):
    monkeypatch.delenv("SMETRIC_RECORD_SALT", raising=False)
    cfg = RecordConfig(enabled=True, dir=str(tmp_path), rotate_bytes=4096, max_bytes=3 * 4096)
    rec = Recorder(cfg, "r/1", page_size=64)
    for i in range(200):
        rec.offer(_served(i, list(range(i, i + 20))))
    rec.close()
    files = sorted(tmp_path.glob("record-r_1-*.jsonl"))
    assert rec.written == 200 and len(files) >= 2
    total = sum(p.stat().st_size for p in files)
    assert total <= 3 * 4096 + 4096  # the cap, and the file being written
    assert _serial_of(files[0]) > 1  # the first files went
    salt = tmp_path / "salt"
    assert stat.S_IMODE(salt.stat().st_mode) == 0o600
    again = Recorder(cfg, "r/1", page_size=64)  # a restart keeps the salt: its ids match
    assert again.ids([5, 6]) == rec.ids([5, 6])
    again.close()


def _serial_of(p) -> int:
    return int(p.stem.rsplit("-", 1)[1])


def test_the_salt_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SMETRIC_RECORD_SALT", "deployment-secret")
    a = Recorder(RecordConfig(enabled=True, dir=str(tmp_path / "a")), "a", 64)
    b = Recorder(RecordConfig(enabled=True, dir=str(tmp_path / "b")), "b", 64)
    assert a.ids([1, 2, 3]) == b.ids([1, 2, 3])  # two replicas, one deployment: mergeable
    assert not (tmp_path / "a" / "salt").exists()
    a.close()
    b.close()


def test_a_full_queue_drops_the_record_and_counts_it(tmp_path):
    rec = Recorder(RecordConfig(enabled=True, dir=str(tmp_path), queue=1), "r", 64)
    rec.close()  # the writer stopped: what is queued stays
    for i in range(5):
        rec.offer(_served(i, [i]))
    assert rec.dropped == 4


def _keys(r) -> list[int]:
    """A shipped trace's prompt as a router's chained block hashes: one key per (owner, block),
    full blocks only (as the router hashes them)."""
    keys = [hash((owner, k)) & (2**63 - 1) for owner, s, e in r.path for k in range(s, e)]
    return keys[: r.input_len // 64]


def test_a_recording_reads_back_as_the_trace_it_was_made_from(tmp_path):
    """The shipped agentic slice served request by request: the recording has every request,
    the same prefix reuse, arrivals and think times counted from the answers, and most parents
    inferred right (sub-agent streams and compacted contexts begin sessions of their own)."""
    src = load_trace(shipped("agentic_slice"))
    cfg = RecordConfig(
        enabled=True, dir=str(tmp_path), block_tokens=64, rotate_bytes=1 << 30, max_bytes=1 << 31
    )
    rec = Recorder(cfg, "r0", page_size=64)
    order = sorted(src.requests, key=lambda r: (r.timestamp, r.idx))
    t0 = 1_700_000_000_000
    for r in order:
        s = Served(t0 + round(r.timestamp * 1000), "chat", r.input_len, _keys(r), None, False)
        s.status, s.output_tokens, s.output_from, s.end_ms = 200, r.output_len, "usage", s.arrival_ms + 2000
        rec.offer(s)
    rec.close(60)
    (path,) = tmp_path.glob("record-r0-*.jsonl")
    first = orjson.loads(path.read_bytes().split(b"\n", 1)[0])
    assert (
        first["block_size"] == 64
        and first["outcome"] == "ok"
        and first["completion"] == first["timestamp"] + 2000
    )
    got = load_trace(path)
    assert len(got.requests) == len(src.requests) and got.block_size == 64
    want, have = reuse_stats(src)[0], reuse_stats(got)[0]
    assert have["ideal_reuse_ratio"] == pytest.approx(want["ideal_reuse_ratio"], rel=0.02)
    assert got.requests[0].timestamp == 0.0
    right = 0
    for mine, r in zip(got.requests, order, strict=True):
        if mine.prev == -1:
            right += r.prev == -1
        else:
            right += order[mine.prev].idx == r.prev
            assert mine.think == pytest.approx(
                max(0.0, mine.timestamp - got.requests[mine.prev].timestamp - 2.0)
            )
    assert right / len(order) >= 0.9, right / len(order)


def test_writes_happen_off_the_request_path(tmp_path):
    rec = Recorder(RecordConfig(enabled=True, dir=str(tmp_path)), "r", 64)
    assert rec._thread.daemon and rec._thread.name == "smetric-record"
    rec.close()
    assert not rec._thread.is_alive()
    assert os.listdir(tmp_path) == ["salt"]  # nothing recorded, no empty file


def test_replicas_recordings_merge_into_one_trace(tmp_path, monkeypatch):
    """Two replicas behind a round-robin balancer: a conversation's turns alternate between
    them, each replica sees half of it; the directory reads as one trace, in arrival order,
    the conversation one session again."""
    monkeypatch.setenv("SMETRIC_RECORD_SALT", "one-deployment")
    cfg = RecordConfig(enabled=True, dir=str(tmp_path))
    reps = [Recorder(cfg, "r0", 64), Recorder(cfg, "r1", 64)]
    prompt: list[int] = []
    for turn in range(6):
        prompt = prompt + [1000 * turn + k for k in range(3)]
        reps[turn % 2].offer(_served(turn, list(prompt)))
    reps[0].offer(_served(9, [7, 7, 7]))  # another conversation, later
    for r in reps:
        r.close()
    assert len(list(tmp_path.glob("record-r*-*.jsonl"))) == 2
    trace = load_trace(tmp_path)
    assert len(trace.requests) == 7 and len(trace.sessions) == 2
    assert [r.turn for r in trace.requests[:6]] == [1, 2, 3, 4, 5, 6]
    assert [r.prev for r in trace.requests[:6]] == [-1, 0, 1, 2, 3, 4]
    assert trace.requests[1].think == pytest.approx(0.5)  # from the answer (+0.5 s), not the arrival
    with pytest.raises(ValueError, match="without recordings"):
        load_trace(tmp_path.parent)


def test_a_recording_against_an_emulated_pool_reads_in_the_pools_seconds(tmp_path):
    """At router.time_factor 0.01 a wall second is 100 of the pool's: the loader divides."""
    rec = Recorder(RecordConfig(enabled=True, dir=str(tmp_path)), "r", 64, time_factor=0.01)
    rec.offer(_served(0, [1, 2]))
    rec.offer(_served(3, [1, 2, 3]))  # 3 wall seconds later; its parent answered 0.5 s after arriving
    rec.close()
    trace = load_trace(tmp_path)
    assert [r.timestamp for r in trace.requests] == pytest.approx([0.0, 300.0])
    assert trace.requests[1].think == pytest.approx(250.0)


class _Log:
    """What happened, in order: the upstream's steps, the booking's release, the trace's end."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def release(self) -> None:
        self.events.append(("released",))

    def end(self, status, error=None, chunks=None, nbytes=None, body=None) -> None:
        self.events.append(("end", status, error, chunks))


def _stream(log: _Log, *chunks: bytes):
    from stack.decode_router.upstream import Upstream

    async def rest():
        for c in chunks[1:]:
            yield c
        log.events.append(("upstream closed",))  # e.g. the prefill half's timing read after [DONE]

    return Upstream(200, "text/event-stream", chunks[0], rest())


def test_a_streamed_answer_ends_when_its_final_event_is_out_not_when_the_upstream_closes():
    """A recording's ``completion`` is what the next turn's think time counts from. The client
    has the answer once ``[DONE]`` is out, and may send its next turn at once, so the trace ends
    there: stamped at the upstream's close, later, a think time would read short (as CI once
    saw). The booking is still released only once the upstream is done."""
    import asyncio

    from stack.prefill_router.api.inference import _relayed

    async def run(n_read: int | None) -> list[tuple]:
        log = _Log()
        up = _stream(log, b'data: {"choices":[]}\n\n', b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n")
        gen = _relayed(up, log, log)
        got = 0
        async for _ in gen:
            got += 1
            log.events.append(("sent", got))
            if got == n_read:
                break  # the client left
        await gen.aclose()
        return log.events

    done = asyncio.run(run(None))
    assert done == [
        ("sent", 1),
        ("sent", 2),
        ("sent", 3),
        ("end", 200, None, 3),  # answered: the final event went out
        ("upstream closed",),
        ("released",),
    ]
    left = asyncio.run(run(2))  # gone before [DONE]: the trace ends in error, once
    assert [e for e in left if e[0] == "end"] == [("end", 200, "client gone", 2)]
    assert ("released",) in left
