"""Dispatch: *when* and *in which order* admitted requests leave the router.

Pure and shared by both drivers (the simulator and the live router), like the policies:
no I/O, no clock, no asyncio. See :mod:`stack.dispatch.dispatcher` for a driver's cycle
(admit, expire, pop until nothing is ready, ask the policy over the ready instances,
next_timer), :mod:`stack.dispatch.orders` for the orders and why plain deadline order
collapses, :mod:`stack.dispatch.readiness` for when an instance takes more work, and
:mod:`stack.dispatch.spec` for a queue's whole description (:class:`DispatchSpec`: its one
parser, builder and label, and the router's and the simulator's defaults).
"""

from __future__ import annotations

from stack.dispatch.dispatcher import Counters, Dispatcher
from stack.dispatch.entry import MAX_QUEUE_WAIT, QUEUE_FULL, Entry, Rejected, State, estimate_size
from stack.dispatch.orders import ORDERS, Deadline, DeadlineDefer, Fifo, Immediate, Laxity, Order, Slack
from stack.dispatch.readiness import Readiness
from stack.dispatch.spec import ROUTER_DISPATCH, SIM_DISPATCH, DispatchSpec, make_dispatcher

__all__ = [
    "MAX_QUEUE_WAIT",
    "ORDERS",
    "QUEUE_FULL",
    "ROUTER_DISPATCH",
    "SIM_DISPATCH",
    "Counters",
    "Deadline",
    "DeadlineDefer",
    "DispatchSpec",
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
]
