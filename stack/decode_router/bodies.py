"""What both workers of a PD hand-off receive: the client's body with SGLang's bootstrap fields
(``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``: the prefill worker's address and a
random room unique per request, lists for batched bodies) and a ``rid`` when the client gave
none, spliced into the raw JSON where it can be."""

from __future__ import annotations

import secrets

import orjson

from stack.pool import Worker

_MAX_ROOM = 2**63 - 1
_BOOT_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class RoomAllocator:
    """Unique random bootstrap rooms in [0, 2^63-1] (remembers recent ones)."""

    def __init__(self, remember: int = 1 << 16) -> None:
        self._recent: dict[int, None] = {}
        self._remember = remember

    def new(self) -> int:
        while True:
            r = secrets.randbits(63)
            if r not in self._recent and r <= _MAX_ROOM:
                self._recent[r] = None
                if len(self._recent) > self._remember:
                    self._recent.pop(next(iter(self._recent)))
                return r


def batch_size(body: dict) -> int | None:
    """Number of requests in a batched ``/generate``, completions or embeddings body (None:
    single; an embeddings ``input`` of strings or of token-id lists is a batch, a Responses
    ``input`` of items is not)."""
    for key in ("text", "prompt"):
        v = body.get(key)
        if isinstance(v, list) and v and not isinstance(v[0], int):
            return len(v)
    v = body.get("input")
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        return len(v)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def pd_body(
    raw: bytes, body: dict, prefill: Worker | None, rooms: RoomAllocator, extra: dict | None = None
) -> tuple[bytes, object, object]:
    """The body both workers receive: (bytes, room(s), rid(s)).

    The bootstrap fields (and a ``rid`` when the client gave none) are spliced into the
    client's raw JSON when it is a plain object without them (no re-serialisation of a
    400 KB body); otherwise the parsed body is re-encoded. ``extra``: fields the router
    sets on top (e.g. ``priority``), replacing the client's own.
    """
    n = batch_size(body)
    if n is None:
        room = rooms.new()
        rid = body.get("rid") or f"smr-{room:016x}"
        boot = (
            None
            if prefill is None
            else {
                "bootstrap_host": prefill.host,
                "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": room,
            }
        )
    else:
        room = [rooms.new() for _ in range(n)]
        rid = body.get("rid") or [f"smr-{r:016x}" for r in room]
        boot = (
            None
            if prefill is None
            else {
                "bootstrap_host": [prefill.host] * n,
                "bootstrap_port": [prefill.bootstrap_port] * n,
                "bootstrap_room": room,
            }
        )
    add = {} if boot is None else dict(boot)
    if "rid" not in body:
        add["rid"] = rid
    if extra:
        add.update(extra)
    if not add:
        return raw, room, rid
    clash = any(k in body for k in _BOOT_KEYS) or (extra is not None and any(k in body for k in extra))
    stripped = raw.rstrip()
    if not clash and body and stripped.endswith(b"}"):
        extra = orjson.dumps(add)  # b'{"...":...}'
        return stripped[:-1] + b"," + extra[1:], room, rid
    merged = dict(body)
    merged.update(add)
    return orjson.dumps(merged), room, rid
