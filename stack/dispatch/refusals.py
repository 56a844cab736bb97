"""The memory of requests refused for their wait, so that their retries are known.

A request the dispatch queue refuses with ``max_queue_wait`` (its wait bound passed) is
refused once, not again: its client retries after the Retry-After, and that retry gets the
wait the bound promises (:class:`~stack.dispatch.Dispatcher`, ``readmitted``). The request
carries no id, so the retry is known by its prompt's fingerprint (``Entry.key``: its length
and last block). :class:`Refusals` remembers each refusal's fingerprint for
:data:`READMIT_WINDOW_S`; each refusal readmits one request.

Router replicas must share one memory: a load balancer spreads a client's attempts over the
replicas, so a retry rarely comes back to the replica that refused it. A memory per replica
lets three retries in four (with four replicas) be refused again, and the agent's turn fails
after the SDK's two retries. The simulator hands one :class:`Refusals` to every replica's
dispatcher; the live router keeps it in Redis as well
(:mod:`stack.prefill_router.shared_refusals`), each replica's own copy serving while Redis is
down.

Pure: no I/O, no clock (time is passed in).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

#: the longest Retry-After an overload answer gives: the official SDKs honour one up to 60 s
RETRY_AFTER_MAX_S = 60
#: how long the fingerprint of a request refused for its wait is remembered, to know its
#: retry: the longest Retry-After, and as long again for the SDKs' backoff and the request's
#: own trip
READMIT_WINDOW_S = 2.0 * RETRY_AFTER_MAX_S


class Refusals:
    """Fingerprints of requests refused for their wait within the last :data:`READMIT_WINDOW_S`
    (see the module docstring); one object may serve several dispatchers (router replicas)."""

    def __init__(self, window_s: float = READMIT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError("refusals: window_s must be > 0")
        self.window_s = window_s
        #: fingerprint -> when each of its refusals not yet retried is forgotten (oldest first)
        self._until: dict[Hashable, deque[float]] = {}
        #: (forget at, fingerprint) of every refusal, in time order
        self._due: deque[tuple[float, Hashable]] = deque()

    def __len__(self) -> int:
        """Refusals remembered and not yet retried (as of the last call)."""
        return sum(len(q) for q in self._until.values())

    def remember(self, key: Hashable, now: float) -> None:
        """A request with fingerprint ``key`` was refused for its wait at ``now``."""
        self.forget(now)
        at = now + self.window_s
        self._until.setdefault(key, deque()).append(at)
        self._due.append((at, key))

    def readmits(self, key: Hashable, now: float) -> bool:
        """Whether ``key`` is the fingerprint of a request refused within the window; if so,
        its oldest such refusal is used up (each refusal readmits one request)."""
        if not self._until:
            return False
        self.forget(now)
        q = self._until.get(key)
        if not q:
            return False
        q.popleft()
        if not q:
            del self._until[key]
        return True

    def forget(self, now: float) -> None:
        """Drop the refusals older than the window."""
        due = self._due
        while due and due[0][0] <= now:
            at, k = due.popleft()
            q = self._until.get(k)
            if q and q[0] <= at:  # not used up by a retry already
                q.popleft()
                if not q:
                    del self._until[k]
