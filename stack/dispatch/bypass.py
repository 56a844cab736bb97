"""Link-bound requests dispatched at once: the dispatch queue's admission bypass.

A request held at the router has not started its global-tier fetch. Where the fetch of the
part of its prefix that no instance holds locally takes longer than computing the rest,
holding it delays the longer of its two stages: such a request is *link-bound*, and the
queue gains nothing by holding it (docs/research/dispatch.md, "Link-bound requests dispatched at
once"). The rule, for one request at its admission::

    fetch_s   = fetch_tokens / fetch_tokens_per_s + backlog_s
    compute_s = cost(new_tokens, context)
    dispatch now  <=>  fetch_tokens > 0 and fetch_s > share * compute_s

with ``fetch_tokens`` the global-tier hit beyond the best local hit of any instance,
``new_tokens`` the prompt beyond the global hit (what is computed wherever the prefix is
fetched), ``backlog_s`` the least link backlog of any instance (the live router measures
none: 0), ``share`` the dispatch key ``bypass`` (``inf``: off). A request the rule
dispatches is routed at once over the whole cluster, as the ``immediate`` order routes;
the others are queued as before.

The same test guards the release of a queued request (the dispatch key ``affinity``,
:func:`unbind_at_release`): released to the ready instances, a request that would be
link-bound there, while an instance that is not ready holds more of its prefix, is routed
over every instance instead.

Pure (no I/O, no clock), one object both drivers call: the simulator at a request's arrival
(:meth:`stack.sim.queues.RouterQueue.bypass_now`), the live router at its admission
(:meth:`stack.prefill_router.routing.PrefillRouter.bypasses`), each from its own view builder's
:class:`~stack.core.types.ClusterView` (:meth:`Bypass.on_view`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from stack.core.types import ClusterView


class _Cost(Protocol):
    def cost(self, n: float, L: float) -> float: ...


def link_bound(
    fetch_tokens: int,
    new_tokens: int,
    context: int,
    fetch_tokens_per_s: float,
    backlog_s: float,
    cost: _Cost,
    share: float = 1.0,
) -> bool:
    """Whether a request's global-tier fetch (``fetch_tokens`` at ``fetch_tokens_per_s``,
    behind ``backlog_s`` seconds of other transfers) takes longer than ``share`` times the
    compute of its ``new_tokens`` at context ``context`` (see the module docstring).
    False with nothing to fetch, no bandwidth, or ``share`` inf."""
    if fetch_tokens <= 0 or not fetch_tokens_per_s > 0 or share == math.inf:
        return False
    fetch_s = fetch_tokens / fetch_tokens_per_s + (backlog_s if backlog_s > 0 else 0.0)
    return fetch_s > share * cost.cost(new_tokens if new_tokens > 0 else 1, context)


@dataclass(frozen=True, slots=True)
class Bypass:
    """The rule with its ``share`` (the dispatch key ``bypass``; see the module docstring)."""

    share: float = 1.0

    def validate(self, key: str = "bypass") -> None:
        """Raises ``ValueError`` unless the share is >= 0 (``key``: the dispatch key it is set by)."""
        if not self.share >= 0 or math.isnan(self.share):
            raise ValueError(f"dispatch: {key} must be >= 0 (inf: off)")

    def decide(
        self,
        fetch_tokens: int,
        new_tokens: int,
        context: int,
        fetch_tokens_per_s: float,
        backlog_s: float,
        cost: _Cost,
    ) -> bool:
        """:func:`link_bound` with this rule's share."""
        return link_bound(fetch_tokens, new_tokens, context, fetch_tokens_per_s, backlog_s, cost, self.share)

    def on_view(self, view: ClusterView, prompt_tokens: int, cost: _Cost) -> bool:
        """The rule on a driver's view of one request of ``prompt_tokens`` tokens: fetch
        tokens are the view's global hit beyond the best local hit of a healthy instance,
        the backlog the least of a healthy instance's link. False with no healthy instance."""
        g = view.global_hit
        if g <= 0 or not view.fetch_tokens_per_s > 0:
            return False
        best, _, backlog = _link_figures(view, None)
        if best < 0:
            return False
        return self.decide(g - best, prompt_tokens - g, prompt_tokens, view.fetch_tokens_per_s, backlog, cost)


def _link_figures(view: ClusterView, ready: Sequence[bool] | None) -> tuple[int, int, float]:
    """Over the healthy instances of ``view``: the best local hit of those ``ready`` marks
    (all with None; -1 if none), the best of all (-1 if none), and the least link backlog
    of the marked ones."""
    best_ready = -1
    best_any = -1
    backlog = math.inf
    for i, s in enumerate(view.instances):
        if not s.healthy:
            continue
        if s.local_hit > best_any:
            best_any = s.local_hit
        if ready is None or ready[i]:
            if s.local_hit > best_ready:
                best_ready = s.local_hit
            if s.fetch_backlog_s < backlog:
                backlog = s.fetch_backlog_s
    return best_ready, best_any, backlog


def unbind_at_release(
    rule: Bypass, view: ClusterView, ready: Sequence[bool], prompt_tokens: int, cost: _Cost
) -> bool:
    """The ``affinity`` rule, at a release: whether a request released to the ``ready``
    instances (the dispatcher's ready mask over ``view.instances``) is routed over every
    healthy instance instead. True when it is link-bound on the ready ones (:func:`link_bound`
    with the best local hit and the least link backlog among them) while an instance that is
    not ready holds more of its prefix locally: holding it to the ready set would fetch over
    the link what another instance already has (past the knee, few instances are ready, and
    requests lose their instance's cache and crowd the link: docs/research/dispatch.md, "Affinity at
    release")."""
    g = view.global_hit
    if g <= 0 or not view.fetch_tokens_per_s > 0:
        return False
    if len(ready) != len(view.instances):
        raise ValueError("unbind_at_release: one ready flag per instance of the view")
    best_ready, best_any, backlog = _link_figures(view, ready)
    if best_ready < 0 or best_any <= best_ready:
        return False
    return rule.decide(
        g - best_ready, prompt_tokens - g, prompt_tokens, view.fetch_tokens_per_s, backlog, cost
    )


__all__ = ["Bypass", "link_bound", "unbind_at_release"]
