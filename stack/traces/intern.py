"""Interning prompts into prefix paths of *owner runs*.

A prompt is a sequence of blocks; two prompts share a prefix when their first k blocks are
identical (chained identity: a block only matches if everything before it matches). Rather
than keep one key per block (~2,000 per agentic request), blocks are grouped into *owners*:
a chain of blocks that one request created and later requests may extend. A request whose
prompt exactly extends an owner's current end takes that owner over (the common agentic
case: each turn appends to the last), so a path stays a handful of runs however many turns
a session has. A request that diverges inside an owner (or after someone else extended it)
starts a new owner that branches off. Runs of one owner always start at the same block, so
a cache can store an owner's cached part as a single end position.
"""

from __future__ import annotations

from stack.kv_tier.prefix_cache import Run


class Interner:
    """Builds paths; owners are dense ints from 0."""

    def __init__(self) -> None:
        self.owner_end: list[int] = []  # current extent (block) of each owner

    @property
    def n_owners(self) -> int:
        return len(self.owner_end)

    def new_frozen(self) -> int:
        """An owner nobody extends (e.g. a prefix shared by many sessions)."""
        self.owner_end.append(-1)
        return len(self.owner_end) - 1

    def _new_owner(self, end: int) -> int:
        self.owner_end.append(end)
        return len(self.owner_end) - 1

    def extend(self, prefix: tuple[Run, ...], lcp: int, n_blocks: int) -> tuple[Run, ...]:
        """Path of a prompt of ``n_blocks`` blocks sharing ``lcp`` blocks with ``prefix``.

        ``prefix`` is the path of an earlier prompt (any length >= lcp).
        """
        if lcp <= 0:
            if n_blocks <= 0:
                return ()
            return ((self._new_owner(n_blocks), 0, n_blocks),)
        cut: list[Run] = []
        for owner, start, end in prefix:
            if start >= lcp:
                break
            cut.append((owner, start, end if end < lcp else lcp))
        if n_blocks <= lcp:
            if n_blocks < lcp:
                return truncate(tuple(cut), n_blocks)
            return tuple(cut)
        owner, start, _ = cut[-1]
        if self.owner_end[owner] == lcp:
            # nobody has put other content after this point yet: extend the owner
            self.owner_end[owner] = n_blocks
            cut[-1] = (owner, start, n_blocks)
        else:
            cut.append((self._new_owner(n_blocks), lcp, n_blocks))
        return tuple(cut)


def truncate(path: tuple[Run, ...], n: int) -> tuple[Run, ...]:
    out = []
    for owner, start, end in path:
        if start >= n:
            break
        out.append((owner, start, end if end < n else n))
    return tuple(out)


def path_blocks(path: tuple[Run, ...]) -> int:
    return path[-1][2] if path else 0
