"""The kinds of events on the simulator's heap (``(time, seq, kind, payload)``).

- ``ARRIVE``: a request arrives at the router (payload: its trace request and session copy).
- ``FORWARD_DONE``: an instance's forward (colocated: a decode interval) ends.
- ``WAKE``: a waiting request's global-tier fetch is done; its instance may schedule it.
- ``WRITTEN``: a finished prefill's KV write over the link is done (``global_write=link``).
- ``QUEUE_TIMER``: the router queue's timer (``Dispatcher.next_timer``): run the queue's
  cycle again, releasing requests to instances now ready and rejecting those that waited
  too long (only with an order other than ``immediate``).
- ``CLIENT_TIMEOUT``: a client's patience with one attempt runs out (``SimConfig.clients``;
  payload: the :class:`~stack.sim.clients.Attempt`).
"""

ARRIVE, FORWARD_DONE, WAKE, WRITTEN, QUEUE_TIMER, CLIENT_TIMEOUT = 0, 1, 2, 3, 4, 5
