"""Feature work off the event loop: a small bounded thread pool, cancelled with its client.

Tokenizing a cold 100k-token prompt takes tens to hundreds of milliseconds; done on the
event loop it stalls every other request for that long (head-of-line blocking). The
router hands such work to this pool instead: HF ``tokenizers`` releases the GIL in
``encode_batch_fast`` (what :meth:`~stack.prefill_router.tokenizer.Tokenizer.encode` uses),
so the loop keeps serving meanwhile; template rendering and block hashing are Python and
share the GIL, which the interpreter hands back to the loop every switch interval (5 ms).

Small bodies (under ``inline_bytes``) stay inline: a pool round trip costs more CPU than
their feature work, and their worst case (a cold 2k-token prompt) is ~1-2 ms. Bodies under
``attempt_bytes`` are first tried inline with a budget of ``budget_chars`` characters of
text not in the token cache (:meth:`FeaturePool.try_inline`): an agent's follow-up, whose
history is cached, is then derived on the loop (render, cache lookups, its new turn: ~1.7 ms
for a 400 KB body), and only a cold one goes to the pool, before anything is tokenized.
Derived on a pool thread, the same warm follow-up cost ~0.45 ms more CPU (the round trip, the
disconnect watch, thread switches: ``benchmarks/router_step_costs.py``).

Bounded: at most ``workers`` jobs run and ``workers + queue`` are admitted; the rest wait
(asynchronously, costing nothing) for a slot. A request whose client disconnects while it
waits or runs is dropped: a waiting job never starts, a running one stops at its next
batch boundary (:class:`~stack.prefill_router.errors.Cancelled`). A job that has not started
``max_wait_s`` after it was handed in (waiting for a slot, or for a thread) never starts: the
request gets the overload answer (:class:`~stack.prefill_router.errors.Overloaded`,
``feature_wait``), as past the dispatch queue's bound; one that has started runs to its end.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stack.prefill_router.errors import Cancelled, NeedsOffload, Overloaded
from stack.prefill_router.tokenizer import cancellable, inline_budget

T = TypeVar("T")

#: bodies smaller than this have their features derived on the loop
INLINE_BYTES = 16 * 1024
#: bodies smaller than this are tried on the loop first, with a budget of uncached text
ATTEMPT_BYTES = 512 * 1024
#: characters of uncached text an inline attempt may tokenize (~1 ms with a BPE tokenizer)
BUDGET_CHARS = 8 * 1024


class FeaturePool:
    """A bounded thread pool for feature extraction (one per router)."""

    def __init__(
        self,
        workers: int = 2,
        queue: int = 62,
        inline_bytes: int = INLINE_BYTES,
        attempt_bytes: int = ATTEMPT_BYTES,
        budget_chars: int = BUDGET_CHARS,
        max_wait_s: float | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self.workers = workers
        #: seconds a job may wait to start (None: unbounded); past them :class:`Overloaded`
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.timed_out = 0  # jobs that never started: they waited longer than max_wait_s
        self.inline_bytes = inline_bytes
        self.attempt_bytes = attempt_bytes
        self.budget_chars = budget_chars
        self.attempted = 0  # bodies tried on the loop (try_inline)
        self.offloaded = 0  # of those, handed on to the pool (too much uncached text)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="smetric-features")
        self._slots = workers + queue
        self._sem: asyncio.Semaphore | None = None
        self.cancelled = 0  # jobs dropped because their client left
        self.running = 0  # jobs on a pool thread now

    def inline(self, nbytes: int) -> bool:
        """Whether a body of ``nbytes`` is small enough to handle on the loop."""
        return nbytes < self.inline_bytes

    def try_inline(self, nbytes: int, fn: Callable[..., T], *args) -> T | None:
        """``fn(*args)`` on the calling thread (the loop) when the body is under
        ``attempt_bytes`` and its text not in the token cache is at most ``budget_chars``;
        None (nothing tokenized) when the request must go to the pool (:meth:`run`)."""
        if nbytes >= self.attempt_bytes:
            return None
        self.attempted += 1
        try:
            with inline_budget(self.budget_chars):
                return fn(*args)
        except NeedsOffload:
            self.offloaded += 1
            return None

    async def run(
        self, fn: Callable[..., T], *args, disconnected: Callable[[], Awaitable[object]] | None = None
    ) -> T:
        """``fn(*args)`` on a pool thread. ``disconnected``: an awaitable factory that
        returns when the client has gone; then the job is cancelled and
        :class:`Cancelled` raised. A job not started within ``max_wait_s`` never starts:
        :class:`Overloaded` (``feature_wait``)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._slots)
        ev = threading.Event()
        started = threading.Event()
        gate = threading.Lock()  # a job starts, or is given up on for waiting too long: not both
        t0 = time.monotonic()
        lim = self.max_wait_s

        def job():
            with gate:
                if ev.is_set():
                    raise Cancelled()
                started.set()
            self.running += 1  # only read as a gauge: a racy count is fine
            try:
                with cancellable(ev):
                    return fn(*args)
            finally:
                self.running -= 1

        def left() -> float | None:
            return None if lim is None else max(0.0, t0 + lim - time.monotonic())

        watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        waits = {watch} if watch is not None else set()
        try:
            acquire = asyncio.ensure_future(self._sem.acquire())
            try:
                done, _ = await asyncio.wait(
                    {acquire, *waits}, timeout=left(), return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:  # the request's task is cancelled: no slot is kept
                acquire.cancel()
                acquire.add_done_callback(self._release_if_acquired)
                raise
            if acquire not in done:
                acquire.cancel()
                acquire.add_done_callback(self._release_if_acquired)
                if watch is not None and watch in done:
                    self.cancelled += 1
                    raise Cancelled()
                raise self._too_late(t0)
            try:
                fut = asyncio.get_running_loop().run_in_executor(self.executor, job)
                while True:
                    # waiting for a thread: bounded by what is left of max_wait_s; running: not
                    timeout = None if started.is_set() else left()
                    done, _ = await asyncio.wait(
                        {fut, *waits}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                    if fut in done:
                        return fut.result()
                    if watch is not None and watch in done:
                        ev.set()  # a waiting job never starts, a running one stops at its next batch boundary
                        fut.add_done_callback(_retrieve)
                        self.cancelled += 1
                        raise Cancelled()
                    with gate:
                        late = not started.is_set()
                        if late:
                            ev.set()  # it never starts
                    if late:
                        fut.add_done_callback(_retrieve)
                        raise self._too_late(t0)
                    # it started just as the time ran out: it runs to its end
            finally:
                self._sem.release()
        finally:
            if watch is not None:
                if watch.done():
                    _retrieve(watch)
                else:
                    watch.cancel()

    def _too_late(self, t0: float) -> Overloaded:
        self.timed_out += 1
        return Overloaded("feature_wait", time.monotonic() - t0, self.retry_after_s)

    def _release_if_acquired(self, f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            self._sem.release()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
