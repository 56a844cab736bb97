"""One dispatch spec: the order, its parameters, readiness, bounds and router replicas.

A :class:`DispatchSpec` is everything a driver needs to build its dispatch queue. There is
one parser for each way a spec is written (the ``name:key=value:...`` text of the command
line and of labels, :meth:`DispatchSpec.parse`; the router config's ``router.dispatch``
mapping, :meth:`DispatchSpec.from_config`), one builder (:meth:`DispatchSpec.build`, also
reached through :func:`make_dispatcher`) and one rendering (:meth:`DispatchSpec.label`,
e.g. ``slack:T=4``: the order and the values that were set, sorted by key, the readiness
threshold written ``T``).

Keys of the text form (and of ``--dispatch-param`` and ``router.dispatch.params``):
readiness ``max_queued_s`` (alias ``T``), ``max_running``, ``fetch_weight``, ``slo_k``,
``slo_q``, ``slo_window``, ``lead_share``, ``release_share`` (:mod:`stack.dispatch.readiness`); bounds
``max_queue``, ``max_queue_wait_s`` (``inf``: unbounded); ``replicas`` (router replicas in
the simulator) and ``replica_mode`` (how they share the queue, a name: :data:`REPLICA_MODES`);
``prio`` (1: each instance computes its waiting requests by priority class,
:mod:`stack.prefill_router.sglang_priority`; the router's ``router.dispatch.sglang_priority``);
``bypass`` (a share: a request whose global-tier fetch takes longer than that share of its
compute is dispatched at once, :mod:`stack.dispatch.bypass`; ``inf``, the default: off; the
router's ``router.dispatch.bypass``); ``affinity`` (a share: a released request that would be
link-bound on the ready instances while another instance holds more of its prefix is routed
over every instance, :func:`stack.dispatch.bypass.unbind_at_release`; ``inf``: off; the
router's ``router.dispatch.affinity``);
anything else is the order's own (``age_k``,
``steal``, ``aged_share``, ``far_k``, ``relax_k``; ``k`` is ``age_k`` or ``relax_k``).

Two defaults, because the two drivers answer different questions:

- :data:`ROUTER_DISPATCH` (``deadline-defer`` with ``age_k`` 1.5, ``aged_share`` 0.125 and ``far_k`` 5:
  feasible requests by deadline, late ones behind them with a bounded share; readiness from the
  traffic's SLOs: T = 0.5 x the median SLO of the last 256 requests, 4 s before the first;
  the fetch counts as lead time behind a link backlog of a median SLO or more; ``bypass``
  and ``affinity`` at share 1: a link-bound request is neither held nor bound to the ready
  instances): what the router ships (``router.dispatch``); the study behind it is docs/dispatch.md, "The default"
  and "Readiness from the SLO". A config that sets ``readiness.max_queued_s`` gets that
  fixed T, with the adaptive keys it does not set off (today's rule before they existed).
- :data:`SIM_DISPATCH` (``immediate``; T = 2 s for an order named without one): the
  simulator's, so that ``smetric sim``/``bench`` run the baselines as their authors ship
  them (routed at arrival, no queue) unless a run names an order, and the queued orders'
  figures in docs/dispatch.md (taken at T = 2 unless labelled) reproduce.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stack.dispatch.bypass import Bypass
from stack.dispatch.dispatcher import Dispatcher
from stack.dispatch.orders import ORDERS, Order
from stack.dispatch.readiness import Readiness

READINESS_KEYS = (
    "max_queued_s",
    "max_running",
    "fetch_weight",
    "slo_k",
    "slo_q",
    "slo_window",
    "lead_share",
    "release_share",
)
BOUND_KEYS = ("max_queue", "max_queue_wait_s")
_ALIASES = {"T": "max_queued_s", "t": "max_queued_s"}
#: the order's own parameter that ``k`` names
_K_OF = {"deadline-defer": "age_k", "slack": "age_k", "laxity": "relax_k"}
#: how a canonical key is written in a label
_LABEL_KEY = {"max_queued_s": "T"}
#: the simulator's readiness (its default T, for an order named without one)
SIM_READINESS = Readiness(max_queued_s=2.0)
#: the instance-order key: 1 = instances order their waiting requests by priority class
PRIO_KEY = "prio"
#: the admission bypass key: link-bound requests dispatched at once (stack/dispatch/bypass.py)
BYPASS_KEY = "bypass"
#: the release key: a request is not held to the ready instances when that would make it
#: link-bound (stack/dispatch/bypass.py, unbind_at_release)
AFFINITY_KEY = "affinity"
#: the keys of ``router.dispatch`` (``sglang_priority`` is the router's, not the queue's)
CONFIG_KEYS = (
    "order",
    "params",
    "readiness",
    *BOUND_KEYS,
    "sglang_priority",
    "replica_mode",
    BYPASS_KEY,
    AFFINITY_KEY,
)
#: how router replicas share the dispatch queue (docs/dispatch.md, "Router replicas"):
#: ``own``, a queue each, releasing in turns; ``claims``, a queue each, but the replica whose
#: next release ranks first cluster-wide claims the ready instance (through the shared state
#: live); ``leader``, one replica's queue holds every request (the others forward);
#: ``hash``, each request to one replica's queue by its session (a queue each, in turns)
REPLICA_MODES = ("own", "claims", "leader", "hash")
#: what the live router runs (claims by default with router.redis_url)
LIVE_REPLICA_MODES = ("own", "claims")
#: the one key whose value is a name, not a number
_NAMED_VALUES = {"replica_mode": REPLICA_MODES}


def parse_items(items: Iterable[str], source: str = "dispatch parameter") -> dict[str, Any]:
    """``key=value`` items as numbers by key (dashes in keys become underscores; ``inf``
    allowed; ``replica_mode`` takes a name). ``source`` names the items in error messages
    (e.g. ``--dispatch-param``)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{source} expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k in _NAMED_VALUES:
            out[k] = _check_named(k, v.strip())
            continue
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"{source} {k!r} must be a number, got {v!r}") from None
    return out


def _check_named(key: str, v: Any) -> str:
    known = _NAMED_VALUES[key]
    if v not in known:
        raise ValueError(f"dispatch: {key} must be one of {', '.join(known)}, got {v!r}")
    return str(v)


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else f"{v:g}"


def _check_order(name: str) -> str:
    if name not in ORDERS:
        raise ValueError(f"unknown dispatch order {name!r} (known: {', '.join(ORDERS)})")
    return name


def canonical_key(order: str, key: str) -> str:
    """``key`` of order ``order`` with its alias resolved (``T`` -> ``max_queued_s``,
    ``k`` -> the order's ``age_k`` / ``relax_k``)."""
    if key == "k":
        return _K_OF.get(order, "k")
    return _ALIASES.get(key, key)


@dataclass(frozen=True)
class DispatchSpec:
    """A dispatch queue, as its drivers build it (see the module docstring).

    ``params``: the order's own parameters that were set (the order's defaults hold for
    the rest: :attr:`order_params` resolves them); ``named``: the readiness, bound and
    replica keys that were set, which the label shows beside ``params``. Building a spec
    never raises on a combination (so a base may carry values for orders chosen later);
    :meth:`validate` and :meth:`build` do.
    """

    order: str = "immediate"
    params: tuple[tuple[str, float], ...] = ()
    readiness: Readiness = SIM_READINESS
    max_queue: int | None = None
    max_queue_wait_s: float | None = None
    replicas: int = 1
    replica_mode: str = "own"
    named: frozenset[str] = frozenset()
    #: ``prio=1``: instances compute by priority class (the router sends SGLang priorities)
    priority: bool = False
    #: ``bypass``: dispatch at once a request whose fetch exceeds this share of its compute
    #: (inf: off; :mod:`stack.dispatch.bypass`)
    bypass: float = math.inf
    #: ``affinity``: at a release, route over every instance a request whose fetch to the
    #: ready ones exceeds this share of its compute (inf: off; unbind_at_release)
    affinity: float = math.inf

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, text: str, base: DispatchSpec | None = None) -> DispatchSpec:
        """``name`` or ``name:key=value:...`` (``replicas=N`` lands in :attr:`replicas`) over
        ``base`` (default :data:`SIM_DISPATCH`: the text form is the simulator's), validated."""
        parts = [p for p in text.strip().split(":") if p]
        if not parts:
            raise ValueError("empty dispatch order")
        name = _check_order(parts[0].strip())
        try:
            values = parse_items(parts[1:])
        except ValueError as e:
            raise ValueError(f"{e} in {text!r}") from None
        return (SIM_DISPATCH if base is None else base).updated(name, values).validate()

    @classmethod
    def from_config(cls, section: Mapping[str, Any], base: DispatchSpec | None = None) -> DispatchSpec:
        """The router config's ``router.dispatch`` mapping (``order``, ``params``,
        ``readiness: {max_queued_s, max_running, fetch_weight}``, ``max_queue``,
        ``max_queue_wait_s``) over ``base`` (default :data:`ROUTER_DISPATCH`), validated.
        What the mapping leaves out keeps ``base``'s value (with another order than
        ``base``'s, not its labelled values); ``readiness`` is ignored by the ``immediate``
        order (it holds no queue)."""
        unknown = sorted(set(section) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"router.dispatch: unknown key(s) {', '.join(unknown)}")
        b = ROUTER_DISPATCH if base is None else base
        order = _check_order(str(section.get("order", b.order)))
        values: dict[str, Any] = {str(k): float(v) for k, v in (section.get("params") or {}).items()}
        if section.get("replica_mode") is not None:
            values["replica_mode"] = _check_named("replica_mode", section["replica_mode"])
            if values["replica_mode"] not in LIVE_REPLICA_MODES:
                raise ValueError(
                    "router.dispatch.replica_mode: the router runs own or claims (leader and hash "
                    "are simulated only: docs/dispatch.md, Router replicas)"
                )
        if order != "immediate":
            rd_section = section.get("readiness") or {}
            for k, v in rd_section.items():
                if k not in READINESS_KEYS:
                    raise ValueError(f"router.dispatch.readiness: unknown key {k!r}")
                if v is not None:
                    values[k] = float(v)
            if rd_section.get("max_queued_s") is not None:
                # a threshold set by hand is a fixed T: the adaptive keys it leaves out are off
                # (a config written before they existed keeps its meaning)
                for k, off in (("slo_k", 0.0), ("lead_share", math.inf), ("release_share", math.inf)):
                    if rd_section.get(k) is None:
                        values[k] = off
        for k in BOUND_KEYS:
            if section.get(k) is not None:
                values[k] = float(section[k])
        for k in (BYPASS_KEY, AFFINITY_KEY):
            if section.get(k) is not None:
                values[k] = float(section[k])
        if section.get("sglang_priority") is True:
            values[PRIO_KEY] = 1.0
        if order != b.order:  # another order: base's readiness, bounds and replicas only
            b = dataclasses.replace(
                b, order=order, params=(), named=frozenset(), bypass=math.inf, affinity=math.inf
            )
        return b.updated(order, values).validate()

    def updated(self, order: str | None = None, values: Mapping[str, Any] | None = None) -> DispatchSpec:
        """A copy running ``order`` (default: this one) with ``values`` set over this spec's
        (keys as in the text form, aliases allowed). Not validated (see :meth:`validate`)."""
        name = _check_order(self.order if order is None else order)
        own = dict(self.params)
        rd: dict[str, float] = {}
        named = set(self.named)
        spec: dict[str, Any] = {}
        for k, v in (values or {}).items():
            key = canonical_key(name, k)
            if key in _NAMED_VALUES:
                spec[key] = _check_named(key, v)
                named.add(key)
                continue
            v = float(v)
            if key in READINESS_KEYS:
                rd[key] = v
            elif key in BOUND_KEYS:
                spec[key] = None if v == math.inf else (int(v) if key == "max_queue" else v)
            elif key == "replicas":
                if v != int(v) or v < 1:
                    raise ValueError("dispatch: replicas must be a whole number >= 1")
                spec[key] = int(v)
            elif key == PRIO_KEY:
                if v not in (0.0, 1.0):
                    raise ValueError("dispatch: prio must be 0 or 1")
                spec["priority"] = v == 1.0
            elif key in (BYPASS_KEY, AFFINITY_KEY):
                spec[key] = v
            else:
                own[key] = v
                continue
            named.add(key)
        return dataclasses.replace(
            self,
            order=name,
            params=tuple(sorted(own.items())),
            readiness=dataclasses.replace(self.readiness, **rd),
            named=frozenset(named),
            **spec,
        )

    # ------------------------------------------------------------------ rendering
    def settings(self) -> dict[str, Any]:
        """The values that were set, by the key a label writes them with (``T`` for
        ``max_queued_s``): the text form's parameters, and the simulator's
        ``SimConfig.dispatch_params``."""
        out: dict[str, Any] = dict(self.params)
        for key in self.named:
            if key in _NAMED_VALUES:
                v = getattr(self, key)
            elif key in READINESS_KEYS:
                v = getattr(self.readiness, key)
            elif key in BOUND_KEYS:
                b = getattr(self, key)
                v = math.inf if b is None else b
            elif key == PRIO_KEY:
                v = float(self.priority)
            elif key in (BYPASS_KEY, AFFINITY_KEY):
                v = getattr(self, key)
            else:
                v = self.replicas
            out[_LABEL_KEY.get(key, key)] = v
        return out

    def label(self) -> str:
        """``order[:key=value...]``, keys sorted: e.g. ``slack:T=4``, ``deadline-defer:age_k=2``."""
        return self.order + "".join(f":{k}={_fmt(v)}" for k, v in sorted(self.settings().items()))

    __str__ = label

    def to_config(self) -> dict[str, Any]:
        """This spec as the router config's ``router.dispatch`` section (demo-live runs the
        router's queue as the simulator beside it does): every order parameter (defaults
        filled in), the readiness threshold always (the router's default differs from the
        simulator's), the other readiness keys and the bounds that were set, and the two link
        rules always (``inf`` where off: the router's default runs them)."""
        if self.replicas != 1:
            raise ValueError(
                "dispatch: replicas are router processes live (launch.router.replicas), not a queue setting"
            )
        prio = {"sglang_priority": True} if self.priority else {}
        if self.order == "immediate":
            return {"order": "immediate", **prio}
        rd: dict[str, Any] = {"max_queued_s": self.readiness.max_queued_s}
        if "max_running" in self.named:
            rd["max_running"] = (
                None if self.readiness.max_running == math.inf else int(self.readiness.max_running)
            )
        for k in READINESS_KEYS[2:]:  # fetch_weight and the adaptive keys, when set
            if k in self.named:
                rd[k] = getattr(self.readiness, k)
        # every order parameter, its defaults filled in: the router merges a section over its
        # own default's parameters, so one left out would run the router's value, not this spec's
        out: dict[str, Any] = {"order": self.order, "params": self.order_params, "readiness": rd, **prio}
        for k in BOUND_KEYS:
            if k in self.named and getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if "replica_mode" in self.named:
            out["replica_mode"] = self.replica_mode
        # always written (inf: off), so that the router runs this spec and not its own default
        for k in (BYPASS_KEY, AFFINITY_KEY):
            out[k] = getattr(self, k) if k in self.named else math.inf
        return out

    # ------------------------------------------------------------------ building
    @property
    def order_params(self) -> dict[str, float]:
        """All of the order's own parameters, its defaults filled in."""
        return self._order().params()

    def _order(self) -> Order:
        cls = ORDERS[_check_order(self.order)]
        try:
            return cls(**dict(self.params))
        except TypeError:
            own = ", ".join(k for k, _ in self.params)
            raise ValueError(f"dispatch order {self.order!r} takes no parameter(s) {own}") from None

    def build(self) -> Dispatcher:
        """A fresh :class:`Dispatcher` for this spec (one per router replica). Raises
        ``ValueError`` on an unknown order or parameter, a value out of range, or a queue
        setting on the ``immediate`` order."""
        order = self._order()
        if order.immediate:
            if self.named & set(READINESS_KEYS):
                raise ValueError("dispatch: the immediate order has no readiness threshold")
            if self.replicas > 1:
                raise ValueError("dispatch: replicas need a queue (an order other than immediate)")
            for k in (BYPASS_KEY, AFFINITY_KEY):
                if k in self.named and getattr(self, k) != math.inf:
                    raise ValueError(f"dispatch: {k} needs a queue (the immediate order holds none)")
        rules: dict[str, Bypass | None] = {}
        for k in (BYPASS_KEY, AFFINITY_KEY):
            share = getattr(self, k)
            rules[k] = None if share == math.inf or order.immediate else Bypass(share)
            if rules[k] is not None:
                rules[k].validate(k)
        return Dispatcher(
            order,
            self.readiness.build(),
            max_queue=self.max_queue,
            max_queue_wait_s=self.max_queue_wait_s,
            replica_mode=self.replica_mode if "replica_mode" in self.named else None,
            bypass=rules[BYPASS_KEY],
            affinity=rules[AFFINITY_KEY],
        )

    def validate(self) -> DispatchSpec:
        """This spec, if it builds (see :meth:`build`)."""
        self.build()
        return self


#: the router's default (``router.dispatch``): deadline-defer (age_k 1.5, aged_share 0.125, no
#: slack stealing; far_k 5: the requests that can still stay under 5x SLO go first among
#: those that missed it), readiness from the traffic's SLOs (T = 0.5 x their median, 4 s before the first),
#: the fetch as lead time behind a long link backlog, and both link rules at share 1
#: (``bypass``, ``affinity``): docs/dispatch.md, "The default"
ROUTER_DISPATCH = DispatchSpec(
    order="deadline-defer",
    params=(("age_k", 1.5), ("aged_share", 0.125), ("far_k", 5.0)),
    readiness=Readiness(max_queued_s=4.0, slo_k=0.5, lead_share=1.0),
    named=frozenset({"max_queued_s", "slo_k", "lead_share", BYPASS_KEY, AFFINITY_KEY}),
    bypass=1.0,
    affinity=1.0,
)
#: the simulator's default: no queue; an order named without a threshold runs at T = 2 s
SIM_DISPATCH = DispatchSpec(order="immediate", readiness=SIM_READINESS)


def make_dispatcher(spec: DispatchSpec | str = SIM_DISPATCH, **values: float) -> Dispatcher:
    """Build the dispatcher of ``spec``; an order's name with ``values`` (text-form keys,
    e.g. ``make_dispatcher("fifo", T=1)``) is the simulator's spec of that order."""
    if isinstance(spec, str):
        spec = SIM_DISPATCH.updated(spec, values)
    elif values:
        spec = spec.updated(None, values)
    return spec.build()
