"""One worker of the pool and its load views.

Each worker (prefill or decode) gets a stable integer id (never reused), which is its
index in the policies' :class:`~stack.core.types.ClusterView` and its bit in the
prefix index.

Load is the router's own accounting, its bookings (prefill work queued on the worker, in new
tokens and in estimated seconds, until the worker's prefill answer returns; requests in
flight until their answer ends), reconciled with the worker's own numbers polled from
``/v1/loads``: the polled counts are floors (other routers may feed the same worker), and
waiting requests the router does not know of are charged at the mean size of its own
charges. A poll older than :data:`LOAD_FRESH_S` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from stack.core.link import LinkFifo

#: How long a polled ``/v1/loads`` answer counts in a load view (prefill routing and decode
#: choice alike); older polls are ignored and the router's own accounting stands alone.
LOAD_FRESH_S = 10.0


@dataclass(slots=True)
class Ticket:
    """One charge's prefill work (a request's), queued on its worker until the prefill answer returns."""

    tokens: int
    seconds: float
    t0: float
    prompt_tokens: int = 0  # the whole prompt, cached part included


class BookedLink(LinkFifo):
    """A worker's global-tier link as the router sees it: one FIFO of the fetches booked on
    it, this router's own and, with router replicas, the others' as the shared state learns
    of them (:class:`stack.prefill_router.shared_links.SharedLinks`); :attr:`booked` counts
    the seconds this router booked itself, what it publishes to the others."""

    __slots__ = ("booked",)

    def __init__(self) -> None:
        super().__init__()
        self.booked = 0.0

    def book(self, now: float, seconds: float) -> float:
        """This router's own fetch: queued, and counted in :attr:`booked`."""
        self.booked += seconds
        return self.push(now, seconds)


@dataclass(slots=True)
class Worker:
    """One worker's membership data, health and load figures (the router's own accounting,
    the worker's polled ``/v1/loads`` and, with router replicas, the others' accounting)."""

    wid: int
    role: str  # "prefill" | "decode"
    url: str
    bootstrap_port: int | None = None
    kv_events: str | None = None
    kv_topic: str = "kv"
    #: the worker's KV-event replay endpoint (SGLang's replay_endpoint): a gap is recovered from it
    kv_replay: str | None = None
    healthy: bool = True
    #: draining (stack/prefill_router/worker_drain.py): routed no new request, removed once it
    #: holds none or at this wall-clock time (epoch seconds); None: not draining
    draining_until: float | None = None
    fails: int = 0  # failures in a row, health checks and calls (a passing one ends the run)
    call_fails: int = 0  # failed calls in a row (a passing call ends the run)
    ejected_at: float = 0.0
    # own accounting
    queued: dict[int, Ticket] = field(default_factory=dict)  # prefill not yet done
    queued_tokens: int = 0
    queued_seconds: float = 0.0
    active_tokens: int = 0  # whole prompts of the requests whose prefill is not done
    inflight: int = 0  # requests whose answer has not ended
    dispatched: int = 0  # requests charged to this worker, ever (its /status "dispatched")
    mean_tokens: float = 0.0
    # PD colocation: requests this worker decodes (prefill done, answer not ended), by
    # ticket, with their context in tokens; empty under disaggregation
    decoding: dict[int, int] = field(default_factory=dict)
    # polled from /v1/loads
    polled_running: int = 0
    polled_waiting: int = 0
    polled_token_usage: float = 0.0
    polled_at: float = 0.0
    # the other router replicas' accounting on this worker (shared state; 0 without Redis)
    shared_tokens: int = 0
    shared_seconds: float = 0.0
    shared_running: int = 0
    # the global-tier link the fetches booked on this worker queue on (one FIFO, as the
    # simulator's Link; fetch_booked): its own, or its host's (router.link: host)
    link: BookedLink = field(default_factory=BookedLink)

    def computed_seconds(self, now: float, time_factor: float = 1.0) -> float:
        """Of the router's own booked seconds (:attr:`queued_seconds`), those this worker has
        computed by ``now`` had it computed its bookings first come, first served since each
        was booked: a request whose compute is done but whose answer has not returned yet
        (the KV hand-off, the store write, the HTTP hop) no longer occupies the GPU. ``now``
        and the bookings' times are wall seconds, their seconds the pool's (``time_factor``:
        wall seconds per second of the pool, router.time_factor)."""
        scale = 1.0 / time_factor
        t_now = now * scale
        ahead = 0.0
        free_at = float("-inf")  # when the bookings before this one are computed
        for tk in self.queued.values():  # in booking order
            start = tk.t0 * scale if tk.t0 * scale > free_at else free_at
            free_at = start + tk.seconds
            if free_at > t_now:
                left = free_at - t_now
                ahead += tk.seconds if left > tk.seconds else left
        done = self.queued_seconds - ahead
        return done if done > 0.0 else 0.0

    def fetch_booked(self, now: float, seconds: float) -> float:
        """Queue a global-tier fetch of ``seconds`` (pool seconds: its tokens over the link's
        bandwidth) on this worker's link at ``now`` (the pool's clock), behind the fetches
        booked before it (on this worker's link, or its host's, shared by the workers on it):
        one FIFO at the link's full bandwidth, as the simulator's
        :class:`stack.sim.instance.Link` and the emulated worker's link
        (:class:`stack.worker.global_tier.GlobalTier`) are. Returns when it is through."""
        return self.link.book(now, seconds)

    def link_backlog(self, now: float) -> float:
        """Seconds of booked fetches still queued on the link at ``now`` (the pool's clock):
        the view's ``fetch_backlog_s``."""
        return self.link.backlog(now)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def view_load(self, fresh_s: float, now: float, sec_per_token: float) -> tuple[int, float, int]:
        """(queued tokens, queued seconds, running requests) as the policies see them: the one
        place they are derived. Queued work is the router's own accounting (plus the other
        replicas'), with polled waiting requests it does not know of charged at the mean
        prompt and ``sec_per_token``. Running: for prefill, the requests whose prefill is
        not done (and, in a colocated pool, those it decodes); for decode, those whose
        answer has not ended. A poll younger than ``fresh_s`` is a floor for running."""
        qt = self.queued_tokens + self.shared_tokens
        qs = self.queued_seconds + self.shared_seconds
        if self.role == "prefill":
            own = len(self.queued) + len(self.decoding) + self.shared_running
        else:
            own = self.inflight
        if now - self.polled_at > fresh_s:
            return qt, qs, own
        unknown = self.polled_waiting - len(self.queued) - self.shared_running
        if unknown > 0 and self.mean_tokens > 0:
            extra = unknown * self.mean_tokens
            qt += int(extra)
            qs += extra * sec_per_token
        polled = self.polled_running + self.polled_waiting
        return qt, qs, (own if own > polled else polled)

    def view_running(self, fresh_s: float, now: float) -> int:
        """Running requests of :meth:`view_load`."""
        return self.view_load(fresh_s, now, 0.0)[2]

    def view_queued(self, fresh_s: float, now: float, sec_per_token: float) -> tuple[int, float]:
        """(queued tokens, queued seconds) of :meth:`view_load`."""
        qt, qs, _ = self.view_load(fresh_s, now, sec_per_token)
        return qt, qs

    def info(self) -> dict:
        return {
            "id": self.wid,
            "role": self.role,
            "url": self.url,
            "bootstrap_port": self.bootstrap_port,
            "kv_events": self.kv_events,
            "kv_replay": self.kv_replay,
            "healthy": self.healthy,
            "draining": self.draining_until is not None,
            "drain_deadline": self.draining_until,
            "queued_tokens": self.queued_tokens,
            "queued_seconds": round(self.queued_seconds, 6),
            "inflight": self.inflight,
            "decoding": len(self.decoding),
            "dispatched": self.dispatched,
            "polled": {
                "running": self.polled_running,
                "waiting": self.polled_waiting,
                "token_usage": self.polled_token_usage,
            },
        }
