"""Dispatch: *when* and *in which order* admitted requests leave the router.

Pure and shared by both drivers (the simulator and the live router), like the policies:
no I/O, no clock, no asyncio. See :mod:`stack.dispatch.dispatcher` for a driver's cycle
(admit, expire, pop until nothing is ready, ask the policy over the ready instances,
next_timer), :mod:`stack.dispatch.orders` for the orders and why plain deadline order
collapses, and :mod:`stack.dispatch.readiness` for when an instance takes more work.
"""

from __future__ import annotations

from stack.dispatch.dispatcher import Counters, Dispatcher, make_dispatcher
from stack.dispatch.entry import MAX_QUEUE_WAIT, QUEUE_FULL, Entry, Rejected, State, estimate_size
from stack.dispatch.orders import ORDERS, Deadline, DeadlineDefer, Fifo, Immediate, Laxity, Order, Slack
from stack.dispatch.readiness import Readiness

DEFAULT_ORDER = "immediate"


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``name`` or ``name:key=value:key=value`` (a bench axis item, e.g.
    ``deadline-defer:age_k=2``) into the order's name and its parameters."""
    parts = [p for p in spec.strip().split(":") if p]
    if not parts:
        raise ValueError("empty dispatch order")
    params: dict[str, float] = {}
    for item in parts[1:]:
        if "=" not in item:
            raise ValueError(f"dispatch parameter expects key=value, got {item!r} in {spec!r}")
        k, v = item.split("=", 1)
        try:
            params[k.strip().replace("-", "_")] = float(v)
        except ValueError:
            raise ValueError(f"dispatch parameter {k!r} must be a number, got {v!r}") from None
    if parts[0] not in ORDERS:
        raise ValueError(f"unknown dispatch order {parts[0]!r} (known: {', '.join(ORDERS)})")
    return parts[0], params


__all__ = [
    "DEFAULT_ORDER",
    "MAX_QUEUE_WAIT",
    "ORDERS",
    "QUEUE_FULL",
    "Counters",
    "Deadline",
    "DeadlineDefer",
    "Dispatcher",
    "Entry",
    "Fifo",
    "Immediate",
    "Laxity",
    "Order",
    "Readiness",
    "Rejected",
    "Slack",
    "State",
    "estimate_size",
    "make_dispatcher",
    "parse_spec",
]
