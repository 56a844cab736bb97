"""The emulated worker's global-tier link: one FIFO of modelled transfers.

A fetch of ``seconds`` (its pages over the link's bandwidth, in wall seconds) queued at
``now`` starts when the transfers queued before it are through and holds the link for its
``seconds``: what the simulator's :class:`stack.sim.instance.Link` and the router's
accounting (:meth:`stack.pool.Worker.fetch_booked`) model. A link of one worker's own (a
NIC per GPU) is :class:`stack.core.link.LinkFifo`; :class:`SharedLink` keeps the FIFO's state
in a file, so the workers given the same file (``--link-file``), in one process or several on
one host, share one NIC. The clock is ``time.monotonic``, which every process of a host reads alike.
"""

from __future__ import annotations

import fcntl
import os
import struct

from stack.core.link import LinkFifo


class SharedLink:
    """A link shared through ``path``: its 8 bytes hold when the transfers queued on it are
    through, read and written under an exclusive lock."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.close(fd)

    def push(self, now: float, seconds: float) -> float:
        """As :meth:`LinkFifo.push`, on the FIFO in the file."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            free_at = struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0
            link = LinkFifo(free_at)
            end = link.push(now, seconds)
            os.pwrite(fd, struct.pack("<d", end), 0)
            return end
        finally:
            os.close(fd)  # releases the lock


def make_link(path: str | None) -> LinkFifo | SharedLink:
    """The worker's link: shared through ``path`` (``--link-file``), or its own."""
    return SharedLink(path) if path else LinkFifo()
