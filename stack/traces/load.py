"""Trace loaders: the flattened agentic format and the Mooncake JSONL format.

Both produce a :class:`Trace` whose requests carry prefix paths (see intern.py).

- agentic (``hash_id_ranges``): 64-token blocks, ids local to a session, seconds; sessions
  hold agent streams (``agent``), each a chain of turns with ``think_time``.
- mooncake (``hash_ids``): chained prefix hashes (512-token blocks by default), ms
  timestamps, optional inferred session fields (``inferred_session_id``,
  ``inferred_parent_idx``, ``inferred_turn``).

A malformed line raises :class:`TraceError` naming the file and the line.
"""

from __future__ import annotations

import gzip
import io
from collections import deque
from pathlib import Path

import numpy as np
import orjson

from stack.core.session_guess import SessionGuess
from stack.traces.intern import Interner
from stack.traces.model import Trace, TraceRequest


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


def _open(path: Path) -> io.TextIOBase:
    raw = path.open("rb")
    head = raw.read(2)
    raw.seek(0)
    if head == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _records(path: Path):
    try:
        fh = _open(path)
    except OSError as e:
        raise TraceError(f"{path}: cannot open: {e.strerror or e}") from None
    with fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):  # noqa: B007
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise TraceError(f"{path}:{lineno}: invalid JSON ({e})") from None
                if not isinstance(rec, dict):
                    raise TraceError(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, rec
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}:{lineno + 1}: unreadable ({e})") from None


def _recording(d: Path):
    """The lines of a recording directory's files (``record-*.jsonl``), merged by timestamp."""
    files = sorted(d.glob("record-*.jsonl"))
    if not files:
        raise TraceError(f"{d}: is a directory without recordings (record-*.jsonl), expected a JSONL trace")
    merged = [x for f in files for x in _records(f)]
    merged.sort(
        key=lambda x: x[1].get("timestamp", 0) if isinstance(x[1].get("timestamp"), int | float) else 0
    )
    if len(files) > 1:
        _reinfer(merged)
    return iter(merged)


def recording_lines(path: str | Path) -> list[dict]:
    """The raw lines of a recording (``router.record``): a directory's ``record-*.jsonl`` merged
    by timestamp, or one JSONL file (gzipped or not), each line as its dict."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    recs = _recording(p) if p.is_dir() else _records(p)
    return [rec for _, rec in recs]


def _reinfer(lines: list) -> None:
    """Sessions inferred again over the merged timeline: each replica inferred its own from
    the requests it served, and a session whose turns went to several replicas (a round-robin
    balancer) joins up again here (the block ids match: the replicas share the salt)."""
    guess = SessionGuess()
    for i, (_, rec) in enumerate(lines):
        ids = rec.get("hash_ids")
        session, turn, parent = guess.place(i, ids if isinstance(ids, list) else [])
        rec["req_idx"], rec["inferred_session_id"], rec["inferred_turn"] = i, session, turn
        rec["inferred_parent_idx"] = parent


def load_trace(
    path: str | Path, fmt: str = "auto", limit: int | None = None, shared_prefix: bool = False
) -> Trace:
    """Load a trace file (``.jsonl`` or ``.jsonl.gz``); ``fmt``: auto | agentic | mooncake.

    ``shared_prefix`` (agentic only): the first ``(tool_tokens + system_tokens) // 64`` blocks
    of every request map to one prefix shared by all sessions (an agent framework's tools and
    system prompt; optimistic, as the trace's README says).

    A directory is a recording (``router.record``): its replicas' files (``record-*.jsonl``)
    read as one trace, merged in arrival order.
    """
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such trace file")
    if p.is_dir():
        recs = _recording(p)
    else:
        recs = _records(p)
    first = next(recs, None)
    if first is None:
        raise TraceError(f"{p}: empty trace")
    if fmt == "auto":
        rec = first[1]
        if "hash_id_ranges" in rec:
            fmt = "agentic"
        elif "hash_ids" in rec:
            fmt = "mooncake"
        else:
            raise TraceError(f"{p}:{first[0]}: unknown trace format (expected hash_id_ranges or hash_ids)")

    def chain():
        yield first
        yield from recs

    it = chain()
    if limit is not None:
        it = (x for i, x in enumerate(it) if i < limit)
    if fmt == "agentic":
        return _load_agentic(p, it, shared_prefix)
    if fmt == "mooncake":
        return _load_mooncake(p, it)
    raise TraceError(f"unknown trace format {fmt!r} (agentic, mooncake, auto)")


def _num(rec: dict, key: str, where: str, default=None, kind=float):
    v = rec.get(key, default)
    if v is None:
        if default is None:
            raise TraceError(f"{where}: missing field {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{where}: field {key!r} must be a number, got {type(v).__name__}")
    if v < 0:
        raise TraceError(f"{where}: field {key!r} must be >= 0")
    return kind(v)


class _Builder:
    """What both loaders accumulate: requests, sessions (by label) and their start times."""

    def __init__(self) -> None:
        self.interner = Interner()
        self.requests: list[TraceRequest] = []
        self.index: dict[object, int] = {}
        self.sessions: list[list[int]] = []
        self.starts: list[float] = []
        self.labels: list = []

    def session(self, label, start: float) -> tuple[int, bool]:
        """Index of the session called ``label`` (created starting at ``start``), and whether it is new."""
        s = self.index.get(label)
        if s is not None:
            return s, False
        s = len(self.sessions)
        self.index[label] = s
        self.sessions.append([])
        self.starts.append(start)
        self.labels.append(label)
        return s, True

    def add(self, req: TraceRequest) -> None:
        self.requests.append(req)
        self.sessions[req.session].append(req.idx)

    def finish(self, path: Path, fmt: str, block_size: int, global_clock: bool) -> Trace:
        if not self.requests:
            raise TraceError(f"{path}: no requests")
        trace = Trace(
            name=path.name,
            fmt=fmt,
            block_size=block_size,
            requests=self.requests,
            sessions=self.sessions,
            session_start=self.starts,
            has_global_clock=global_clock,
            n_owners=self.interner.n_owners,
            session_labels=self.labels,
        )
        return _mark_shared(trace)


def _mark_shared(trace: Trace) -> Trace:
    """For each owner, how far requests of sessions other than its creator's reference it."""
    first = [-1] * trace.n_owners
    upto = [0] * trace.n_owners
    for r in trace.requests:
        for o, _, b in r.path:
            f = first[o]
            if f < 0:
                first[o] = r.session
            elif f != r.session and b > upto[o]:
                upto[o] = b
    trace.shared_upto = upto
    trace.n_shared = sum(1 for u in upto if u)
    return trace


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


def _load_agentic(path: Path, recs, shared_prefix: bool = False) -> Trace:
    bs = 64
    b = _Builder()
    interner, requests, starts = b.interner, b.requests, b.starts
    shared = interner.new_frozen() if shared_prefix else -1
    stream_index: list[dict[str, int]] = []
    last_in_stream: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
    recent: list[deque] = []
    firsts: list[tuple[int, np.ndarray] | None] = []
    for lineno, rec in recs:
        where = f"{path}:{lineno}"
        sid = rec.get("session_id")
        if sid is None or isinstance(sid, (dict, list)):
            raise TraceError(f"{where}: missing or invalid field 'session_id'")
        ranges = rec.get("hash_id_ranges")
        if not isinstance(ranges, list):
            raise TraceError(f"{where}: field 'hash_id_ranges' must be a list of [a, b] ranges")
        try:
            parts = [np.arange(int(a), int(b) + 1, dtype=np.int64) for a, b in ranges]
        except (TypeError, ValueError):
            raise TraceError(f"{where}: field 'hash_id_ranges' must be a list of [a, b] ranges") from None
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        L = max(1, _num(rec, "input_length", where, kind=int))  # a forward computes >= 1 token
        out = _num(rec, "output_length", where, default=0, kind=int)
        ts = _num(rec, "timestamp", where)
        t_in = _num(rec, "t_in_session", where, default=0.0)
        think = _num(rec, "think_time", where, default=0.0)
        n_blocks = min(int(rec.get("n_blocks") or ids.shape[0]), ids.shape[0], L // bs)
        ids = ids[:n_blocks]
        s, new = b.session(sid, ts - t_in)
        if new:
            stream_index.append({})
            recent.append(deque(maxlen=3))
            firsts.append(None)
        agent = str(rec.get("agent") or "main")
        st = stream_index[s].setdefault(agent, len(stream_index[s]))
        idx = len(requests)
        prev_entry = last_in_stream.get((s, st))
        # candidate parents: the stream's predecessor, the session's recent requests, its first
        best_lcp, best_path = 0, ()
        cands = [prev_entry] if prev_entry else []
        cands.extend(recent[s])
        if firsts[s] is not None:
            cands.append(firsts[s])
        for cidx, cids in cands:
            lcp = _lcp(ids, cids)
            if lcp > best_lcp:
                best_lcp, best_path = lcp, requests[cidx].path
        if shared >= 0:
            k = min(n_blocks, (int(rec.get("tool_tokens") or 0) + int(rec.get("system_tokens") or 0)) // bs)
            if best_lcp < k:
                best_path, best_lcp = ((shared, 0, k),), k
        rpath = interner.extend(best_path, best_lcp, n_blocks)
        turn = int(rec.get("turn") or (1 if prev_entry is None else requests[prev_entry[0]].turn + 1))
        b.add(
            TraceRequest(
                idx=idx,
                session=s,
                stream=st,
                turn=turn,
                timestamp=ts,
                offset=ts - starts[s],
                think=think,
                input_len=L,
                output_len=out,
                prev=prev_entry[0] if prev_entry else -1,
                path=rpath,
                n_blocks=n_blocks,
            )
        )
        entry = (idx, ids)
        last_in_stream[(s, st)] = entry
        recent[s].append(entry)
        if firsts[s] is None:
            firsts[s] = entry
    return b.finish(path, "agentic", bs, global_clock=False)


def _load_mooncake(path: Path, recs, block_size: int = 512) -> Trace:
    """A Mooncake JSONL trace. Beside the format's fields it reads a recording's
    (:mod:`stack.prefill_router.record`): ``block_size`` (tokens per block id; 512 when absent),
    string ``req_idx`` / ``inferred_parent_idx`` references, and ``completion`` (when the
    request was answered, ms): a follow-up's think time is then counted from its parent's
    answer, not from its parent's arrival. Timestamps count from the first line's (0 in the
    shipped traces; Unix-epoch milliseconds in a recording), over its ``time_factor`` (a
    recording against an emulated pool; 1 when absent)."""
    b = _Builder()
    interner, requests, starts = b.interner, b.requests, b.starts
    seen: dict[int, int] = {}  # chained block hash -> index of a request containing it
    by_req_idx: dict[object, int] = {}
    done: list[float | None] = []  # each request's answer (s), when the trace says
    t_first: float | None = None
    for lineno, rec in recs:
        where = f"{path}:{lineno}"
        if t_first is None:
            # a recording against an emulated pool: its wall times over the pool's time factor
            per_s = 1000.0 * _num(rec, "time_factor", where, default=1.0)
            if per_s <= 0:
                raise TraceError(f"{where}: field 'time_factor' must be > 0")
            t_first = _num(rec, "timestamp", where) / per_s
            block_size = int(_num(rec, "block_size", where, default=block_size, kind=int)) or block_size
        hids = rec.get("hash_ids")
        if not isinstance(hids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hids
        ):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
        L = max(1, _num(rec, "input_length", where, kind=int))  # a forward computes >= 1 token
        out = _num(rec, "output_length", where, default=0, kind=int)
        ts = _num(rec, "timestamp", where) / per_s - t_first
        fin = rec.get("completion")
        done.append(
            fin / per_s - t_first if isinstance(fin, int | float) and not isinstance(fin, bool) else None
        )
        n_blocks = len(hids)
        # longest prefix already seen: chained hashes make presence monotone along the prompt
        lo, hi = 0, n_blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hids[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        lcp = lo
        prefix = requests[seen[hids[lcp - 1]]].path if lcp else ()
        p = interner.extend(prefix, lcp, n_blocks)
        idx = len(requests)
        for h in hids[lcp:]:
            seen[h] = idx
        req_idx = rec.get("req_idx", idx)
        by_req_idx[req_idx] = idx
        parent = rec.get("inferred_parent_idx", -1)
        known = isinstance(parent, str) or (
            isinstance(parent, int) and not isinstance(parent, bool) and parent >= 0
        )
        prev = by_req_idx.get(parent, -1) if known else -1
        sid = rec.get("inferred_session_id", rec.get("session_id", f"r{idx}"))
        s, _ = b.session(sid, ts)
        turn = int(
            rec.get("inferred_turn") or rec.get("turn") or (requests[prev].turn + 1 if prev >= 0 else 1)
        )
        since = (requests[prev].timestamp if done[prev] is None else done[prev]) if prev >= 0 else ts
        think = max(0.0, ts - since)
        b.add(
            TraceRequest(
                idx=idx,
                session=s,
                stream=0,
                turn=turn,
                timestamp=ts,
                offset=ts - starts[s],
                think=think,
                input_len=L,
                output_len=out,
                prev=prev,
                path=p,
                n_blocks=n_blocks,
            )
        )
    return b.finish(path, "mooncake", block_size, global_clock=True)
