"""Clients that time out and retry, for the simulator (``SimConfig.clients``; off by default).

Real agents reach the router through an HTTP stack that gives up and tries again:

- **Patience.** A request that has had no first token after ``patience_s`` is abandoned by its
  client: by default the SDKs' own read timeout (600 s in the OpenAI and Anthropic SDKs). A
  streamed request gets keep-alives from the router once it has left the queue
  (``router.stream_keepalive_s``), so that is its bound behind a load balancer too; a request
  that is not streamed (or the router with keep-alives off) gets nothing before its answer, and
  a load balancer in between bounds its wait by its idle timeout (commonly 60 s: set
  ``patience_s`` to it). On abandonment the router cancels
  the request: one still in its queue leaves it, one waiting on an instance is taken off that
  instance; one whose prefill has started is aborted on its worker and stops at its next chunk
  boundary (SGLang drops an aborted chunked request before its next chunk), the chunks computed
  spent; one in its last chunk completes, and its answer reaches nobody.
- **Retries.** The SDKs retry an overload answer (429, 5xx, 529) and a timeout up to
  ``max_retries`` times (2 by default in both SDKs), after the answer's ``Retry-After`` when
  it gives one of at most ``retry_after_max_s``, else after an exponential backoff
  (``backoff_s`` x 2^(retry-1), at most ``backoff_max_s``) shortened by up to a quarter at
  random (jitter). A retry is a new request to the router: its deadline counts from the retry,
  so a fresh, feasible retry goes first by deadline.
- **Measured from the first attempt.** TTFT counts from the client's first attempt, so that
  refusing a request and serving its retry cannot look faster than serving it late; a request
  whose last attempt is refused or abandoned failed, and its agent stream ends there.

The defaults are the SDKs' documented behaviour and the common load-balancer timeout, not
values fitted to a result. Pure: the engine (:mod:`stack.sim.engine`) drives it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClientModel:
    """How clients give up and retry (see the module docstring)."""

    #: seconds without a first token before the client abandons the attempt
    patience_s: float = 600.0
    #: retries after the first attempt (an overload answer or a timeout each use one)
    max_retries: int = 2
    #: the first retry's backoff, doubling each retry, at most ``backoff_max_s``
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    #: a Retry-After longer than this is ignored (the backoff is used instead)
    retry_after_max_s: float = 60.0

    def describe(self) -> str:
        """The model in a few words (the ``clients`` figure of a run)."""
        return f"patience {self.patience_s:g}s, {self.max_retries} retries"

    def validate(self) -> None:
        if not self.patience_s > 0:
            raise ValueError("clients: patience_s must be > 0")
        if self.max_retries < 0 or self.max_retries != int(self.max_retries):
            raise ValueError("clients: max_retries must be a whole number >= 0")
        if not (0 <= self.backoff_s <= self.backoff_max_s):
            raise ValueError("clients: need 0 <= backoff_s <= backoff_max_s")

    def delay(self, retry: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Seconds before retry number ``retry`` (1 = the first retry): the answer's
        Retry-After when it gives a usable one, else the jittered exponential backoff."""
        if retry_after_s is not None and 0 < retry_after_s <= self.retry_after_max_s:
            return retry_after_s
        base = min(self.backoff_s * 2.0 ** (retry - 1), self.backoff_max_s)
        return base * (1.0 - 0.25 * rng.random())


#: an attempt's states
LIVE, ANSWERED, ABANDONED, REFUSED = 0, 1, 2, 3


class Attempt:
    """One attempt of a client's request: ``n`` (1: the first), ``first`` (when the first
    attempt was sent), ``start`` (this one), and where it is: queued at the router
    (``entry``, in the queue of ``disp``) or on an instance (``job``, ``inst``)."""

    __slots__ = ("n", "first", "start", "state", "entry", "disp", "job", "inst")

    def __init__(self, n: int, first: float, start: float) -> None:
        self.n = n
        self.first = first
        self.start = start
        self.state = LIVE
        self.entry: Any = None
        self.disp: Any = None
        self.job: Any = None
        self.inst: Any = None

    def retry(self, at: float) -> Attempt:
        return Attempt(self.n + 1, self.first, at)
