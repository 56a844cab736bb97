"""One global-tier link (NIC) as a FIFO of transfers: when the transfers queued on it are
through. The router's accounting of the fetches it books (:class:`stack.pool.Worker`) and the
emulated worker's own link (:mod:`stack.worker.link`) keep it; the simulator's
:class:`stack.sim.instance.Link` is the same FIFO with its measurements."""

from __future__ import annotations


class LinkFifo:
    """A link at its full bandwidth: a transfer starts when those queued before it are
    through and holds the link for its seconds."""

    __slots__ = ("free_at",)

    def __init__(self, free_at: float = 0.0) -> None:
        self.free_at = free_at

    def push(self, now: float, seconds: float) -> float:
        """Queue a transfer of ``seconds`` at ``now``; returns when it is through."""
        start = self.free_at if self.free_at > now else now
        self.free_at = start + seconds
        return self.free_at

    def backlog(self, now: float) -> float:
        """Seconds of transfers still queued at ``now``."""
        b = self.free_at - now
        return b if b > 0.0 else 0.0
