"""One request's accounting on its prefill worker (and decode worker, under PD).

A :class:`Booking` is made by :meth:`WorkerRegistry.book` in one synchronous call, so the
accounting of both workers starts together, and it is the one place that undoes it:
:meth:`Booking.prefill_done` when the prefill answer returns, :meth:`Booking.release` when
the request's answer ends or fails. Both are idempotent, so every exit path of a request
may call them without counting twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stack.pool.worker import Worker


class Accounts(Protocol):
    """What a booking undoes its tickets with (the :class:`~stack.pool.registry.WorkerRegistry`)."""

    def prefill_done(self, w: Worker, ticket: int, decoding: bool = False) -> None: ...

    def finished(self, w: Worker, ticket: int) -> None: ...


@dataclass(slots=True)
class Booking:
    """The tickets one request holds on the pool."""

    registry: Accounts
    prefill: Worker
    prefill_ticket: int
    decode: Worker | None = None
    decode_ticket: int | None = None
    released: bool = False

    def prefill_done(self) -> bool:
        """The prefill answer returned: its queued work leaves the prefill worker's load.
        True on the call that did it (False if already done or released)."""
        if self.prefill_ticket not in self.prefill.queued:
            return False
        # without a decode worker the prefill worker decodes the request too (colocated)
        self.registry.prefill_done(self.prefill, self.prefill_ticket, decoding=self.decode is None)
        return True

    def release(self) -> None:
        """The request's answer ended (or failed): both workers' accounting is undone."""
        if self.released:
            return
        self.released = True
        self.registry.finished(self.prefill, self.prefill_ticket)
        if self.decode is not None and self.decode_ticket is not None:
            self.registry.finished(self.decode, self.decode_ticket)
