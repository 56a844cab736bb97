"""Sessions inferred from prompts alone, as a recording (``router.record``) infers them and as
a merged recording is read back (:mod:`stack.traces.load`): the request carries no session
id, but an agent's turn extends its previous prompt, so a chain of block ids that contains an
earlier request's last block continues it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SessionGuess:
    """Sessions inferred from prompts alone. A request continues the most recent earlier request
    whose last full block it contains, the deepest such block winning (an agent's turn extends
    its previous prompt); otherwise it begins a session. A request has one follow-up: a second
    request that extends the same one begins a session of its own (two conversations that
    share only a system prompt are not one session). Remembers the last blocks of the latest
    ``capacity`` requests."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        #: last block id -> [request idx, session, turn, followed up]
        self._ends: OrderedDict[int, list] = OrderedDict()
        self._sessions = 0

    def place(self, idx: int, ids: Sequence[int]) -> tuple[int, int, int]:
        """(session, turn, parent's idx or -1) of request ``idx`` with block ids ``ids``."""
        ends = self._ends
        # the deepest block a recent request ended at (the lookups run in C: filter, map)
        parent = next(filter(None, map(ends.get, reversed(ids))), None)
        if parent is None or parent[3]:
            session, turn, prev = self._sessions, 1, -1
            self._sessions += 1
        else:
            parent[3] = True
            prev, session, turn = parent[0], parent[1], parent[2] + 1
        if ids:
            ends[ids[-1]] = [idx, session, turn, False]
            ends.move_to_end(ids[-1])
            if len(ends) > self.capacity:
                ends.popitem(last=False)
        return session, turn, prev
