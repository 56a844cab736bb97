"""Recording what the router serves (``router.record``): a trace the simulator reads, made from
live traffic, so that ``smetric sim`` and its studies can run on an operator's own load.

**What a line holds.** One JSON object per inference request the router admitted (its body
parsed), in the Mooncake JSONL format of :mod:`stack.traces.load` with fields of our own beside
it:

- ``timestamp``: its arrival, milliseconds since the Unix epoch (the loader counts from the
  first line; files of several replicas merge by sorting on it);
- ``input_length``: prompt tokens; ``output_length``: the answer's tokens where the answer says
  (``usage``, or ``/generate``'s ``meta_info``), else for a stream the chunks relayed (an
  upper bound of events, not tokens: ``output_from`` says which), else 0;
- ``hash_ids``: the prompt's chained block ids, one per full ``block_size``-token block, each
  the router's own block hash keyed with a secret salt (BLAKE2b, 63 bits): two prompts share
  an id exactly when they share the prefix up to it, and neither text nor tokens can be
  recovered from it without the salt;
- ``req_idx``, ``inferred_session_id``, ``inferred_parent_idx``, ``inferred_turn``: the session
  the recorder infers (:class:`SessionGuess`: a request continues the latest earlier request
  whose whole prompt it extends), per replica: ``<replica>:<n>``;
- ``session_hint``: the session id the client sent, if any (header or body field);
- ``time_factor``: the router's ``router.time_factor`` (1 in production; an emulated pool's
  factor otherwise: the loader divides the times by it, so they read in the pool's seconds);
- ``endpoint``, ``stream``, ``status``, ``outcome`` (``ok``, or why not), ``prefill``,
  ``decode``, ``decision`` (the policy's decision kind), ``ttft_ms``, ``completion`` (its end,
  ms since the epoch: a stream's final event handed to the client, a whole answer's body
  ready; the simulator reads think time from it, not from the gap between arrivals);
- ``router_wait_ms``: its time in the router's dispatch queue (None: it never waited there);
  ``prefill_queue_s``, ``prefill_forward_s``, ``cached_tokens``: the prefill worker's own
  timing of its prefill half, in the pool's seconds, where the router reads it
  (``router.cost_model`` observe or learn, a PD pool, a path that carries ``meta_info``),
  else None. Less those, ``ttft_ms`` is the path beyond the prefill: what ``smetric
  calibrate --handoff-from`` fits as the PD hand-off.

**What is not in it**: text, token ids, headers, keys, client addresses.

**Off the request path.** The request path appends a small record to a bounded queue (a
request that finds it full is not recorded, and counted); a writer thread hashes, infers the
session and writes. Files (``record-<replica>-<n>.jsonl``) rotate at ``rotate_bytes``; once the
directory's recordings pass ``max_bytes`` the oldest files go.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from stack.core.session_guess import SessionGuess

if TYPE_CHECKING:
    from stack.config import RecordConfig
    from stack.core.observations import Observation
    from stack.prefill_router.api.parse import Parsed
    from stack.prefill_router.routed import Routed
    from stack.prefill_router.tracing import NullTrace, RequestTrace

log = logging.getLogger("stack.router")

#: how often the writer wakes to write what came (seconds)
WRITE_EVERY_S = 0.2

_USAGE = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')


@dataclass(slots=True)
class Served:
    """What the request path notes of one request, for the writer."""

    arrival_ms: int
    endpoint: str
    prompt_tokens: int = 0
    hashes: Sequence[int] = ()
    session_hint: str | None = None
    stream: bool = False
    prefill: str | None = None
    decode: str | None = None
    decision: str | None = None
    first_ms: int | None = None
    end_ms: int | None = None
    status: int = 0
    outcome: str = "ok"
    output_tokens: int = 0
    output_from: str = "none"
    router_wait_ms: float | None = None
    #: the prefill worker's own timing of the prefill half (``router.cost_model`` observe or
    #: learn, PD): seconds queued there and in its forwards, and the tokens it reused
    prefill_queue_s: float | None = None
    prefill_forward_s: float | None = None
    cached_tokens: int | None = None


def output_tokens_of(body: bytes) -> int | None:
    """The answer's output tokens as its body states them (OpenAI's ``usage.completion_tokens``,
    Anthropic's and Responses' ``usage.output_tokens``, ``/generate``'s
    ``meta_info.completion_tokens``); None when it does not. A batched body: the sum."""
    found = _USAGE.findall(body[-65536:]) if body else []
    return sum(int(x) for x in found) if found else None


MASK64 = 2**64 - 1


class BlockIds:
    """The router's block hashes (``page_size`` tokens each) as recorded block ids: every
    ``block_tokens / page_size``-th hash (each chained hash stands for its whole prefix), keyed
    with the salt. Recently keyed hashes are remembered, so a follow-up's prefix costs one
    dictionary lookup per block, done in C (``map``); only new blocks are keyed in Python."""

    def __init__(self, salt: bytes, page_size: int, block_tokens: int, memo: int = 500_000) -> None:
        if block_tokens % page_size:
            raise ValueError(
                f"record.block_tokens ({block_tokens}) must be a multiple of page_size ({page_size})"
            )
        key = hashlib.blake2b(salt, digest_size=32).digest()
        #: BLAKE2b keyed with the salt's digest, nothing hashed yet: each block id is a copy of
        #: it fed the 8 bytes of one hash (the same digest as keying anew, at less cost)
        self.keyed = hashlib.blake2b(key=key, digest_size=8)
        self.step = block_tokens // page_size
        self.memo: OrderedDict[int, int] = OrderedDict()
        self.memo_size = memo

    def __call__(self, hashes: Sequence[int]) -> list[int]:
        raw = hashes[self.step - 1 :: self.step]
        memo = self.memo
        out = list(map(memo.get, raw))
        if None in out:
            keyed, from_bytes = self.keyed, int.from_bytes
            for i, v in enumerate(out):
                if v is None:
                    h = raw[i]
                    d = keyed.copy()
                    d.update((h & MASK64).to_bytes(8, "little"))
                    out[i] = memo[h] = from_bytes(d.digest(), "little") >> 1
            while len(memo) > self.memo_size:
                memo.popitem(last=False)
        return out


def load_salt(cfg: RecordConfig, directory: Path) -> bytes:
    """The deployment's salt: ``$<salt_env>``, else ``<dir>/salt`` (made once, mode 0600)."""
    env = os.environ.get(cfg.salt_env, "")
    if env:
        return env.encode()
    path = directory / "salt"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        salt = secrets.token_hex(32).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(salt)
        return salt


class Recorder:
    """``router.record``: takes :class:`Served` records off the request path (:meth:`offer`)
    and writes them as trace lines in a thread of its own (module docstring)."""

    def __init__(self, cfg: RecordConfig, replica: str, page_size: int, time_factor: float = 1.0) -> None:
        self.cfg = cfg
        self.replica = re.sub(r"[^A-Za-z0-9_.-]", "_", replica) or "router"
        self.dir = Path(cfg.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ids = BlockIds(load_salt(cfg, self.dir), page_size, cfg.block_tokens)
        self.block_size = cfg.block_tokens
        self.time_factor = time_factor
        self.sessions = SessionGuess()
        self.dropped = 0  # records that found the queue full
        self.written = 0
        #: records not yet written: a deque (an append is one atomic step, no lock, no wake-up)
        self._q: deque[Served] = deque()
        self._stop = threading.Event()
        self._idx = 0
        self._fh = None
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="smetric-record", daemon=True)
        self._thread.start()

    # -- the request path ------------------------------------------------------------------
    def trace(self, inner: RequestTrace | NullTrace, endpoint: str) -> RecordedTrace:
        """The request's trace, noting what the recording needs on the way."""
        return RecordedTrace(inner, self, Served(int(time.time() * 1000), endpoint))

    def offer(self, s: Served) -> None:
        """Queue ``s`` for the writer (it wakes every :data:`WRITE_EVERY_S` for what came); past
        ``router.record.queue`` waiting records, ``s`` is dropped and counted."""
        if len(self._q) >= self.cfg.queue:
            self.dropped += 1
        else:
            self._q.append(s)

    # -- the writer --------------------------------------------------------------------------
    def _run(self) -> None:
        """Every :data:`WRITE_EVERY_S`, what came since, written in one go (one write, one flush:
        the request path pays no thread hand-off per request)."""
        while True:
            stopping = self._stop.wait(WRITE_EVERY_S)
            self._drain()
            if stopping:
                break
        if self._fh is not None:
            self._fh.close()

    def _drain(self) -> None:
        q = self._q
        lines = []
        while q:
            try:
                lines.append(self.line(q.popleft()))
            except Exception:  # noqa: BLE001 - a recording never stops the router
                log.exception("recording a request")
            time.sleep(0)  # the GIL back to the event loop between records: no burst
        if lines:
            self._write(lines)

    def line(self, s: Served) -> bytes:
        """The trace line of ``s`` (and the session it is placed in)."""
        idx = self._idx
        self._idx += 1
        ids = self.ids(s.hashes)
        session, turn, parent = self.sessions.place(idx, ids)
        rec: dict[str, Any] = {
            "timestamp": s.arrival_ms,
            "input_length": s.prompt_tokens,
            "output_length": s.output_tokens,
            "hash_ids": ids,
            "block_size": self.block_size,
            "time_factor": self.time_factor,
            "req_idx": f"{self.replica}:{idx}",
            "inferred_session_id": f"{self.replica}:{session}",
            "inferred_parent_idx": f"{self.replica}:{parent}" if parent >= 0 else -1,
            "inferred_turn": turn,
            "session_hint": s.session_hint,
            "endpoint": s.endpoint,
            "stream": s.stream,
            "status": s.status,
            "outcome": s.outcome,
            "output_from": s.output_from,
            "prefill": s.prefill,
            "decode": s.decode,
            "decision": s.decision,
            "ttft_ms": None if s.first_ms is None else s.first_ms - s.arrival_ms,
            "completion": s.end_ms,
            "router_wait_ms": s.router_wait_ms,
            "prefill_queue_s": s.prefill_queue_s,
            "prefill_forward_s": s.prefill_forward_s,
            "cached_tokens": s.cached_tokens,
        }
        return orjson.dumps(rec) + b"\n"

    def _write(self, lines: list[bytes]) -> None:
        """``lines`` appended, a new file begun wherever the next would pass ``rotate_bytes``."""
        chunk: list[bytes] = []
        for data in lines:
            if self._fh is None or self._size + len(data) > self.cfg.rotate_bytes:
                self._flush(chunk)
                self._rotate()
            chunk.append(data)
            self._size += len(data)
            self.written += 1
        self._flush(chunk)

    def _flush(self, chunk: list[bytes]) -> None:
        if chunk:
            self._fh.write(b"".join(chunk))
            self._fh.flush()
            chunk.clear()

    def _rotate(self) -> None:
        if self._fh is not None:
            self._fh.close()
        n = 1 + max((_serial(p) for p in self.dir.glob(f"record-{self.replica}-*.jsonl")), default=0)
        self._fh = (self.dir / f"record-{self.replica}-{n:05d}.jsonl").open("ab")
        self._size = 0
        self._trim()

    def _trim(self) -> None:
        """Delete the oldest recordings (any replica's) while the directory holds more than
        ``max_bytes`` (the file being written stays)."""
        files = sorted(self.dir.glob("record-*.jsonl"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        current = Path(self._fh.name)
        for p in files:
            if total <= self.cfg.max_bytes:
                break
            if p == current:
                continue
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            log.info("recording: %s removed (router.record.max_bytes)", p.name)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def _serial(p: Path) -> int:
    try:
        return int(p.stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


class RecordedTrace:
    """A request's trace that also notes what the recording needs: each stage goes on to the
    inner trace (:class:`~stack.prefill_router.tracing.RequestTrace`, or the null one), and the
    end offers the record to the :class:`Recorder`."""

    __slots__ = ("inner", "rec", "s", "ended")

    def __init__(self, inner: RequestTrace | NullTrace, rec: Recorder, s: Served) -> None:
        self.inner, self.rec, self.s = inner, rec, s
        self.ended = False

    def parsed(
        self, prompt_tokens: int | None = None, body_bytes: int | None = None, parsed: Parsed | None = None
    ) -> None:
        if parsed is not None:
            s = self.s
            p = parsed
            f = p.features
            s.prompt_tokens, s.hashes, s.session_hint, s.stream = (
                f.prompt_tokens,
                f.hashes,
                f.session_id,
                p.stream,
            )
        self.inner.parsed(prompt_tokens, body_bytes)

    def queue_wait(self, start_ns: int, end_ns: int, outcome: str) -> None:
        s = self.s
        s.router_wait_ms = (s.router_wait_ms or 0.0) + (end_ns - start_ns) / 1e6
        self.inner.queue_wait(start_ns, end_ns, outcome)

    def routed(self, r: Routed, policy: str, attempt: int) -> None:
        s = self.s
        s.prefill = r.prefill.url
        s.decode = r.decode.url if r.decode is not None else None
        s.decision = r.kind.value
        self.inner.routed(r, policy, attempt)

    def not_routed(self, reason: str, attempt: int) -> None:
        self.s.outcome = reason
        self.inner.not_routed(reason, attempt)

    def hand_off(self, r: Routed):
        return self.inner.hand_off(r)

    def prefill_done(self) -> None:
        self.inner.prefill_done()

    def prefill_timed(self, ob: Observation) -> None:
        s = self.s
        s.prefill_queue_s, s.prefill_forward_s, s.cached_tokens = ob.queue_s, ob.forward_s, ob.cached_tokens
        self.inner.prefill_timed(ob)

    def upstream_failed(self, role: str, message: str) -> None:
        self.inner.upstream_failed(role, message)

    def first_token(self) -> None:
        self.s.first_ms = int(time.time() * 1000)
        self.inner.first_token()

    def end(
        self,
        status: int,
        error: str | None = None,
        chunks: int | None = None,
        nbytes: int | None = None,
        body: bytes | None = None,
    ) -> None:
        if not self.ended:
            self.ended = True
            s = self.s
            s.end_ms = int(time.time() * 1000)
            s.status = status
            if error:
                s.outcome = error
            elif status != 200 and s.outcome == "ok":
                s.outcome = f"http_{status}"
            n = output_tokens_of(body) if body is not None and status == 200 else None
            if n is not None:
                s.output_tokens, s.output_from = n, "usage"
            elif chunks:
                s.output_tokens, s.output_from = chunks, "chunks"
            if s.hashes or s.prompt_tokens:  # parsed: an admitted request
                self.rec.offer(s)
        self.inner.end(status, error, chunks, nbytes)

    def detach(self) -> None:
        self.inner.detach()

    def __getattr__(self, name: str):  # anything else the inner trace offers (e.g. ids)
        return getattr(self.inner, name)
