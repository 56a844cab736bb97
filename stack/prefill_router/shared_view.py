"""What one read of the replicas' shared state returns.

Three scripts end by reading the view (the plain read, a claim that lost, and the exchange of
heads), and all three answer in one shape: the registry version, the other live replicas'
figures summed per worker, the workers' booking versions, and the other live replicas'
heads. :func:`parse_view` turns that reply into a :class:`Snapshot`. Workers are named in
Redis by :func:`wkey`, ``<role>|<url>``, the same on every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stack.pool import Worker


def wkey(w: Worker) -> str:
    """The worker's name in the shared hashes: the same on every replica."""
    return f"{w.role}|{w.url}"


def text(x) -> str:
    """A value of a Redis reply as a string (the client answers bytes)."""
    return x.decode() if isinstance(x, bytes | bytearray) else str(x)


@dataclass(slots=True)
class Snapshot:
    """The other live replicas' figures per worker key, and the booking versions."""

    others: dict[str, tuple[int, float, int]]
    versions: dict[str, int]
    workers_ver: int
    #: the other live replicas' heads (replica_mode claims): replica -> rank
    heads: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    #: per worker key, the wall seconds of global-tier fetches the other live replicas have
    #: booked on its link since they started (a sum of counters that only grow)
    links: dict[str, float] = field(default_factory=dict)


def parse_view(reply) -> Snapshot:
    """The :class:`Snapshot` of a script's view reply (``READ``, a lost ``CLAIM``, ``HEADS``)."""
    wver, flat, vers, hflat = reply
    others, links = {}, {}
    for i in range(0, len(flat), 5):
        k = text(flat[i])
        others[k] = (
            int(float(text(flat[i + 1]))),
            float(text(flat[i + 2])),
            int(float(text(flat[i + 3]))),
        )
        links[k] = float(text(flat[i + 4]))
    versions = {text(vers[i]): int(text(vers[i + 1])) for i in range(0, len(vers), 2)}
    heads = {}
    for i in range(0, len(hflat), 2):
        parts = text(hflat[i + 1]).split()
        if len(parts) == 4:
            heads[text(hflat[i])] = (int(parts[1]), float(parts[2]), float(parts[3]))
    return Snapshot(others, versions, int(text(wver)), heads, links)
