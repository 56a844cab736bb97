"""SGLang KV events: decoding, and a ZMQ subscriber feeding the prefix index.

Wire format (SGLang's ZMQ publisher, same as vLLM's):
multipart ``[topic, seq (8-byte big-endian), msgpack payload]``; payload
``[ts, [events...], dp_rank?]``. Each event is either the array form

    ["BlockStored", [hashes], parent|None, token_ids, block_size, lora_id|None, medium?]
    ["BlockRemoved", [hashes], medium?]
    ["AllBlocksCleared"]

(trailing defaults may be omitted) or a tagged map, e.g. SGLang 0.5.23's
``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": None, "token_ids":
[...], "block_size": 16, "lora_id": None, "medium": "GPU"}``. Both are decoded.

A sequence gap means events were lost. With the worker's replay endpoint (SGLang's
``replay_endpoint`` in ``--kv-events-config``: the last 10,000 batches, served to a ZMQ DEALER
that sends ``["", start_seq]``; stack/worker/events.py serves the same) the subscriber asks
for the missed batches and applies them in order; only when the buffer no longer holds them
(or there is no replay endpoint, or it does not answer) does it call ``on_gap`` (the router
drops that worker's index and rebuilds it from the events that follow). A subscriber that
starts after its worker did (a restarted router) first replays what the buffer still holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

log = logging.getLogger("stack.kv_events")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    dp_rank: int | None = None


class EventDecodeError(ValueError):
    pass


def _hash(x) -> int:
    """Engine hashes may be signed int64, unsigned, or bytes: normalise to an int."""
    if isinstance(x, int):
        return x
    if isinstance(x, bytes | bytearray):
        return int.from_bytes(x, "big", signed=False)
    if isinstance(x, str):
        return int(x, 16) if x.startswith("0x") else int(x)
    raise EventDecodeError(f"bad block hash {type(x).__name__}")


def _medium(x) -> str | None:
    if x is None:
        return None
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return str(x)


def _tag(x) -> str:
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return str(x)


def decode_event(ev) -> KVEvent | None:
    """One event in array or map form; unknown event types give ``None``."""
    if isinstance(ev, dict):
        ev = {_tag(k): v for k, v in ev.items()}
        kind = _tag(ev.get("type", ev.get("kind", "")))
        if kind == "BlockStored":
            parent = ev.get("parent_block_hash")
            return BlockStored(
                [_hash(h) for h in ev.get("block_hashes") or []],
                None if parent is None else _hash(parent),
                list(ev.get("token_ids") or []),
                int(ev.get("block_size") or 0),
                ev.get("lora_id"),
                _medium(ev.get("medium")),
            )
        if kind == "BlockRemoved":
            return BlockRemoved([_hash(h) for h in ev.get("block_hashes") or []], _medium(ev.get("medium")))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(ev, list | tuple) and ev:
        kind = _tag(ev[0])
        if kind == "BlockStored":
            f = list(ev[1:]) + [None] * (6 - (len(ev) - 1))
            hashes, parent, tokens, bs, lora, medium = f[:6]
            return BlockStored(
                [_hash(h) for h in hashes or []],
                None if parent is None else _hash(parent),
                list(tokens or []),
                int(bs or 0),
                lora,
                _medium(medium),
            )
        if kind == "BlockRemoved":
            f = list(ev[1:]) + [None] * (2 - (len(ev) - 1))
            return BlockRemoved([_hash(h) for h in f[0] or []], _medium(f[1]))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    raise EventDecodeError("event is neither an array nor a map")


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one msgpack payload ``[ts, events, dp_rank?]`` (or a map with those keys)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types
        raise EventDecodeError(f"bad msgpack payload: {e}") from None
    if isinstance(obj, dict):
        ts, evs, dp = obj.get("ts", 0.0), obj.get("events", []), obj.get("data_parallel_rank")
    elif isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, evs = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    else:
        raise EventDecodeError("payload is not [ts, events, dp_rank?]")
    if not isinstance(evs, list | tuple):
        raise EventDecodeError("events is not an array")
    out = EventBatch(float(ts or 0.0), [], dp)
    for ev in evs:
        d = decode_event(ev)
        if d is not None:
            out.events.append(d)
    return out


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise EventDecodeError("sequence number is not 8 bytes")
    return int.from_bytes(raw, "big", signed=False)


def encode_batch(seq: int, events: list, ts: float = 0.0, dp_rank: int | None = None, topic: bytes = b"kv"):
    """Encode a multipart message as SGLang publishes it (for tests and emulated workers)."""
    payload = [ts, events] if dp_rank is None else [ts, events, dp_rank]
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


class SequenceTracker:
    """Detects gaps in a publisher's sequence numbers (per dp rank is not needed: one seq)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.gaps = 0

    def check(self, seq: int) -> bool:
        """True when ``seq`` follows the previous one (or is the first seen)."""
        ok = self.last is None or seq == self.last + 1
        if not ok:
            self.gaps += 1
        self.last = seq
        return ok


#: SGLang's end-of-replay marker: sequence -1 as 8 signed big-endian bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSubscriber:
    """Subscribes to one worker's KV event stream (zmq.asyncio SUB socket); with ``replay``
    (the worker's replay endpoint), recovers what it missed instead of dropping the index."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        on_batch: Callable[[EventBatch], None],
        on_gap: Callable[[], None],
        ctx=None,
        replay: str | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.on_batch = on_batch
        self.on_gap = on_gap
        self.replay = replay
        self.replay_timeout_s = replay_timeout_s
        self._ctx = ctx
        self._task: asyncio.Task | None = None
        self._sock = None
        self.seq = SequenceTracker()
        self.received = 0
        self.errors = 0
        #: batches applied from replays; gaps recovered from the buffer; gaps it could not cover
        self.replayed = 0
        self.recovered_gaps = 0
        self.dropped_gaps = 0
        #: the seqs the last replay applied: a live message among them is a duplicate
        self._dedupe: tuple[int, int] | None = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = self._ctx or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        sock = self._sock
        if self.replay:  # started after the worker: what its buffer still holds
            await self._recover(0, startup=True)
        while True:
            try:
                parts = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # socket closed or broken
                log.warning("kv events %s: receive failed: %s", self.endpoint, type(e).__name__)
                await asyncio.sleep(0.5)
                continue
            try:
                if len(parts) == 3:
                    _, seq_raw, payload = parts
                    seq = decode_seq(seq_raw)
                elif len(parts) == 2:
                    seq_raw, payload = parts
                    seq = decode_seq(seq_raw)
                else:
                    raise EventDecodeError(f"{len(parts)}-part message")
                if self._replayed(seq):
                    continue  # applied from the replay already
                if self.seq.last is not None and seq != self.seq.last + 1:
                    self.seq.gaps += 1
                    await self._recover(self.seq.last + 1)
                    if self._replayed(seq):
                        continue  # the replay carried it
                self._apply(seq, payload)
            except EventDecodeError as e:
                self.errors += 1
                log.warning("kv events %s: undecodable message: %s", self.endpoint, e)
            except Exception:  # never let a bad message kill the subscriber
                self.errors += 1
                log.exception("kv events %s: handler failed", self.endpoint)

    def _replayed(self, seq: int) -> bool:
        """Whether the last replay applied ``seq`` (a live copy then is skipped); the window
        closes at the first live message past it."""
        if self._dedupe is None:
            return False
        lo, hi = self._dedupe
        if lo <= seq <= hi:
            return True
        self._dedupe = None
        return False

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_payload(payload)
        self.received += 1
        self.seq.last = seq
        self.on_batch(batch)

    async def _recover(self, start: int, startup: bool = False) -> None:
        """Replay from ``start`` and apply what comes; on a gap the buffer must still hold
        ``start``, else the worker's index is dropped (``on_gap``) and rebuilt from the
        replayed batches and what follows."""
        got = await self._ask_replay(start) if self.replay else None
        covered = bool(got) and got[0][0] == start
        if not startup and not covered:
            why = "no replay endpoint" if not self.replay else "the replay did not cover it"
            log.warning(
                "kv events %s: sequence gap from %d (%s), dropping the worker's index",
                self.endpoint,
                start,
                why,
            )
            self.dropped_gaps += 1
            self.on_gap()
        elif not startup:
            self.recovered_gaps += 1
            log.info(
                "kv events %s: sequence gap from %d recovered by replay (%d batches)",
                self.endpoint,
                start,
                len(got),
            )
        for seq, payload in got or []:
            try:
                self._apply(seq, payload)
                self.replayed += 1
            except EventDecodeError as e:
                self.errors += 1
                log.warning("kv events %s: undecodable replayed message: %s", self.endpoint, e)
        if got:
            self._dedupe = (got[0][0], got[-1][0])

    async def _ask_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The worker's buffered batches from ``start`` on, in order; None when the replay
        endpoint does not answer within ``replay_timeout_s``."""
        import zmq
        import zmq.asyncio

        ctx = self._ctx or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = asyncio.get_running_loop().time() + self.replay_timeout_s
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise TimeoutError
                parts = await asyncio.wait_for(sock.recv_multipart(), left)
                if len(parts) != 4:  # ["", topic, seq, payload], or ["", "", END_SEQ, ""] at the end
                    raise EventDecodeError(f"{len(parts)}-part replay message")
                if parts[2] == END_SEQ:
                    return out
                out.append((decode_seq(parts[2]), parts[3]))
        except (TimeoutError, EventDecodeError, zmq.ZMQError) as e:
            log.warning(
                "kv events %s: replay from %s failed: %s", self.endpoint, self.replay, type(e).__name__
            )
            return None
        finally:
            sock.close(0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
