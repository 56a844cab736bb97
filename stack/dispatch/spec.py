"""One dispatch spec: the order, its parameters, readiness, bounds and router replicas.

A :class:`DispatchSpec` is everything a driver needs to build its dispatch queue, and one
typed model (pydantic): it *is* the router config's ``router.dispatch`` section (its fields,
with :class:`~stack.dispatch.readiness.Readiness` as ``readiness``), the simulator's
``SimConfig.dispatch``, what ``--dispatch``/``--dispatch-param`` and a bench axis parse
into, and what a label prints. Each key is defined once: the readiness keys as fields of
:class:`~stack.dispatch.readiness.Readiness`, the queue's own (bounds, replicas, link rules,
priorities) as fields of :class:`DispatchSpec`, an order's parameters by the order's class
(:mod:`stack.dispatch.orders`). The values that were set (pydantic's ``model_fields_set``,
:attr:`DispatchSpec.named`) are what a label shows. Two parsers (the ``name:key=value:...``
text, :meth:`DispatchSpec.parse`; a config mapping over a base, :meth:`DispatchSpec.from_config`),
one builder (:meth:`DispatchSpec.build`, also reached through :func:`make_dispatcher`) and
two renderings (:meth:`DispatchSpec.label`, e.g. ``slack:T=4``: the order and the values that
were set, sorted by key, the readiness threshold written ``T``; :meth:`DispatchSpec.to_config`).

Keys of the text form (and of ``--dispatch-param`` and ``router.dispatch.params``):
readiness ``max_queued_s`` (alias ``T``), ``max_running``, ``fetch_weight``, ``slo_k``,
``slo_q``, ``slo_window``, ``lead_share``, ``release_share`` (:mod:`stack.dispatch.readiness`); bounds
``max_queue``, ``max_queue_wait_s``, ``max_wait_k`` (``inf``: unbounded); ``replicas`` (router replicas in
the simulator) and ``replica_mode`` (how they share the queue, a name: :data:`REPLICA_MODES`);
``prio`` (1: each instance computes its waiting requests by priority class,
:mod:`stack.dispatch.sglang_priority`; the router's ``router.dispatch.sglang_priority``);
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
  the fetch counts as lead time on an instance whose link backlog is at least its own queued
  prefill seconds (``lead_queue``, chosen by issue 48's protocol); ``bypass``
  and ``affinity`` at share 1: a link-bound request is neither held nor bound to the ready
  instances): what the router ships (``router.dispatch``); the study behind it is docs/research/dispatch.md, "The default"
  and "Readiness from the SLO". No key turns another off: a config that wants a fixed T
  writes ``readiness.mode: fixed`` (and ``lead_queue: false`` to stop counting the fetch as
  lead time; ``lead_share`` in its place needs ``lead_queue: false`` too); one that sets only
  ``readiness.max_queued_s`` sets where the adaptive T starts.
- :data:`SIM_DISPATCH` (``immediate``; T = 2 s for an order named without one): the
  simulator's, so that ``smetric sim``/``bench`` run the baselines as their authors ship
  them (routed at arrival, no queue) unless a run names an order, and the queued orders'
  figures in docs/research/dispatch.md (taken at T = 2 unless labelled) reproduce.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_serializer

from stack.dispatch.bypass import Bypass
from stack.dispatch.dispatcher import Dispatcher
from stack.dispatch.orders import ORDERS, Order
from stack.dispatch.readiness import Readiness
from stack.dispatch.refusals import Refusals

#: the readiness keys a label and ``--dispatch-param`` take (``mode`` follows ``slo_k`` there)
READINESS_KEYS = tuple(k for k in Readiness.model_fields if k != "mode")
BOUND_KEYS = ("max_queue", "max_queue_wait_s", "max_wait_k")
_ALIASES = {"T": "max_queued_s", "t": "max_queued_s", "prio": "sglang_priority"}
#: the order's own parameter that ``k`` names
_K_OF = {"deadline-defer": "age_k", "slack": "age_k", "laxity": "relax_k"}
#: how a canonical key is written in a label
_LABEL_KEY = {"max_queued_s": "T", "sglang_priority": "prio"}
#: the instance-order key of the text form: 1 = instances order their waiting requests by
#: priority class (``sglang_priority``)
PRIO_KEY = "prio"
#: the admission bypass key: link-bound requests dispatched at once (stack/dispatch/bypass.py)
BYPASS_KEY = "bypass"
#: the release key: a request is not held to the ready instances when that would make it
#: link-bound (stack/dispatch/bypass.py, unbind_at_release)
AFFINITY_KEY = "affinity"
#: how router replicas share the dispatch queue (docs/research/dispatch.md, "Router replicas"):
#: ``own``, a queue each, releasing in turns; ``claims``, a queue each, but the replica whose
#: next release ranks first cluster-wide claims the ready instance (through the shared state
#: live); ``leader``, one replica's queue holds every request (the others forward);
#: ``hash``, each request to one replica's queue by its session (a queue each, in turns)
REPLICA_MODES = ("own", "claims", "leader", "hash")
#: what the live router runs (claims by default with router.redis_url)
LIVE_REPLICA_MODES = ("own", "claims")
#: the queue's own keys (the model's fields beside order, params and readiness)
_QUEUE_KEYS = (*BOUND_KEYS, "replicas", "replica_mode", "sglang_priority", BYPASS_KEY, AFFINITY_KEY)
#: the keys of ``router.dispatch`` (``replicas`` are router processes live, not a queue setting)
CONFIG_KEYS = ("order", "params", "readiness", *(k for k in _QUEUE_KEYS if k != "replicas"))


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
        if k == "replica_mode":
            out[k] = _check_mode(v.strip())
            continue
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"{source} {k!r} must be a number, got {v!r}") from None
    return out


def _check_mode(v: Any) -> str:
    if v not in REPLICA_MODES:
        raise ValueError(f"dispatch: replica_mode must be one of {', '.join(REPLICA_MODES)}, got {v!r}")
    return str(v)


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else f"{v:g}"


def _check_order(name: str) -> str:
    if name not in ORDERS:
        raise ValueError(f"unknown dispatch order {name!r} (known: {', '.join(ORDERS)})")
    return name


def canonical_key(order: str, key: str) -> str:
    """``key`` of order ``order`` with its alias resolved (``T`` -> ``max_queued_s``,
    ``prio`` -> ``sglang_priority``, ``k`` -> the order's ``age_k`` / ``relax_k``)."""
    if key == "k":
        return _K_OF.get(order, "k")
    return _ALIASES.get(key, key)


class DispatchSpec(BaseModel):
    """A dispatch queue, as its drivers build it and as ``router.dispatch`` writes it (see
    the module docstring). Field defaults are the simulator's (:data:`SIM_DISPATCH`).

    ``params``: the order's own parameters that were set (the order's defaults hold for the
    rest: :attr:`order_params` resolves them). A spec holds any combination (so a base may
    carry values for orders chosen later); :meth:`validate` and :meth:`build` refuse the
    ones that do not build (an unknown parameter, a queue setting on ``immediate``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    order: str = Field("immediate", description="the release order: " + ", ".join(ORDERS))
    params: dict[str, float] = Field(
        default_factory=dict,
        description="the order's own parameters (e.g. deadline-defer: age_k, aged_share, far_k)",
    )
    readiness: Readiness = Field(default_factory=Readiness, description="when an instance takes more work")
    max_queue: int | None = Field(
        None,
        ge=0,
        description="requests the queue holds; one more gets the overload answer (null: unbounded)",
    )
    max_queue_wait_s: float | None = Field(
        None, ge=0, description="seconds a request may wait; past them the overload answer (null: unbounded)"
    )
    max_wait_k: float | None = Field(
        None,
        gt=0,
        description="times its own TTFT SLO a request may wait (the sooner of this and max_queue_wait_s); "
        "past it the overload answer (null: unbounded)",
    )
    replicas: int = Field(1, description="router replicas (the simulator; live, launch.router.replicas)")
    replica_mode: Literal["own", "claims", "leader", "hash"] | None = Field(
        None,
        description="how router replicas share the queue: claims (the default with Redis) releases "
        "in one order across replicas, own in turns (leader and hash: simulated only)",
    )
    sglang_priority: StrictBool = Field(
        False,
        description="give each request an SGLang priority from its deadline (workers run with "
        "--enable-priority-scheduling; label key prio)",
    )
    bypass: float = Field(
        math.inf,
        description="dispatch at once a request whose global-tier fetch (beyond the best local hit) "
        "takes longer than this share of its compute (inf or null: off)",
    )
    affinity: float = Field(
        math.inf,
        description="route over every worker a released request that would be link-bound on the "
        "ready ones while another holds more of its prefix (inf or null: off)",
    )

    @field_validator("bypass", "affinity", mode="before")
    @classmethod
    def _null_is_off(cls, v: Any) -> Any:
        return math.inf if v is None else v

    @field_validator("max_queue", "max_queue_wait_s", "max_wait_k", mode="before")
    @classmethod
    def _inf_is_unbounded(cls, v: Any) -> Any:
        if v is None or (isinstance(v, (int, float)) and v == math.inf):
            return None
        if isinstance(v, float) and v == int(v):
            return int(v) if v >= 0 else v
        return v

    @field_validator("order")
    @classmethod
    def _known_order(cls, v: str) -> str:
        return _check_order(v)

    # ------------------------------------------------------------------ what was set
    @property
    def named(self) -> frozenset[str]:
        """The readiness and queue keys that were set (a label shows them beside ``params``)."""
        rd = self.readiness.model_fields_set - {"mode"}
        return frozenset((self.model_fields_set & set(_QUEUE_KEYS)) | rd)

    def _values(self) -> dict[str, Any]:
        """Every readiness and queue value, by canonical key."""
        out: dict[str, Any] = {k: getattr(self.readiness, k) for k in Readiness.model_fields}
        out.update({k: getattr(self, k) for k in _QUEUE_KEYS})
        return out

    @classmethod
    def _make(
        cls, order: str, params: Mapping[str, float], values: Mapping[str, Any], named: Iterable[str]
    ) -> DispatchSpec:
        """A spec of these values whose set keys are ``named`` (validated field by field)."""
        named = set(named)
        rd_keys = set(Readiness.model_fields)
        rv = {k: v for k, v in values.items() if k in rd_keys}
        if "mode" not in named and "slo_k" in rv:  # the text form: mode follows slo_k
            rv["mode"] = "adaptive" if rv["slo_k"] > 0 else "fixed"
        rd = Readiness.model_validate(rv)
        rd = Readiness.model_construct(_fields_set=named & rd_keys, **dict(rd))
        q = {k: values[k] for k in _QUEUE_KEYS if k in values}
        spec = cls.model_validate({"order": order, "params": dict(params), "readiness": rd, **q})
        return cls.model_construct(
            _fields_set={"order", "params", "readiness"} | (named & set(_QUEUE_KEYS)), **dict(spec)
        )

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
        """The router config's ``router.dispatch`` mapping over ``base`` (default
        :data:`ROUTER_DISPATCH`), validated. What the mapping leaves out keeps ``base``'s
        value; with another order than ``base``'s, not its order parameters or link rules (the
        order as studied), and nothing of ``base``'s is named. ``readiness`` is ignored by the
        ``immediate`` order (it holds no queue); ``null`` turns a share or bound off."""
        if isinstance(section, DispatchSpec):
            return section
        unknown = sorted(set(section) - set(CONFIG_KEYS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], CONFIG_KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (known: {', '.join(CONFIG_KEYS)})"
            raise ValueError(f"router.dispatch.{unknown[0]}: unknown key{hint}")
        b = ROUTER_DISPATCH if base is None else base
        order = _check_order(str(section.get("order", b.order)))
        values: dict[str, Any] = {}
        if section.get("replica_mode") is not None:
            values["replica_mode"] = _check_mode(section["replica_mode"])
            if values["replica_mode"] not in LIVE_REPLICA_MODES:
                raise ValueError(
                    "router.dispatch.replica_mode: the router runs own or claims (leader and hash "
                    "are simulated only: docs/research/dispatch.md, Router replicas)"
                )
        if order != "immediate":
            rd_section = section.get("readiness") or {}
            for k in rd_section:
                if k not in Readiness.model_fields:
                    near = difflib.get_close_matches(k, Readiness.model_fields, n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise ValueError(f"router.dispatch.readiness.{k}: unknown key{hint}")
            values.update(rd_section)
            if rd_section.get("mode") == "fixed" and "slo_k" not in rd_section:
                values["slo_k"] = 0.0  # the explicit switch: a fixed T
        for k in (*BOUND_KEYS, BYPASS_KEY, AFFINITY_KEY, "sglang_priority"):
            if k in section:
                values[k] = section[k]
        named = set(values) | (b.named if order == b.order else set())
        own = dict(b.params) if order == b.order else {}
        own.update({str(k): float(v) for k, v in (section.get("params") or {}).items()})
        merged = b._values()
        if order != b.order:  # another order: base's readiness, bounds and replicas only
            merged.update({BYPASS_KEY: math.inf, AFFINITY_KEY: math.inf})
            if ORDERS[_check_order(order)].immediate:  # no queue: nothing to bound
                merged.update({k: None for k in BOUND_KEYS if k not in values})
        merged.update(values)
        return cls._make(order, own, merged, named).validate()

    def updated(self, order: str | None = None, values: Mapping[str, Any] | None = None) -> DispatchSpec:
        """A copy running ``order`` (default: this one) with ``values`` set over this spec's
        (keys as in the text form, aliases allowed). Not validated (see :meth:`validate`)."""
        name = _check_order(self.order if order is None else order)
        own = dict(self.params)
        merged = self._values()
        named = set(self.named)
        for k, v in (values or {}).items():
            key = canonical_key(name, k)
            if key == "replica_mode":
                merged[key] = _check_mode(v)
            elif key in Readiness.model_fields or key in _QUEUE_KEYS:
                merged[key] = self._number(key, v)
            else:
                own[key] = float(v)
                continue
            named.add(key)
        return self._make(name, own, merged, named)

    @staticmethod
    def _number(key: str, v: Any) -> Any:
        """A text-form value of a readiness or queue key, checked where its meaning asks."""
        v = float(v)
        if key == "replicas" and (v != int(v) or v < 1):
            raise ValueError("dispatch: replicas must be a whole number >= 1")
        if key == "sglang_priority":
            if v not in (0.0, 1.0):
                raise ValueError("dispatch: prio must be 0 or 1")
            return v == 1.0
        if key in BOUND_KEYS and v != math.inf:
            return int(v) if key == "max_queue" else v
        if key == "replicas":
            return int(v)
        return v

    # ------------------------------------------------------------------ rendering
    def settings(self) -> dict[str, Any]:
        """The values that were set, by the key a label writes them with (``T`` for
        ``max_queued_s``, ``prio`` for ``sglang_priority``): the text form's parameters."""
        out: dict[str, Any] = dict(self.params)
        values = self._values()
        for key in self.named:
            v = values[key]
            if key in BOUND_KEYS and v is None:
                v = math.inf
            elif key == "sglang_priority":
                v = float(v)
            out[_LABEL_KEY.get(key, key)] = v
        return out

    def label(self) -> str:
        """``order[:key=value...]``, keys sorted: e.g. ``slack:T=4``, ``deadline-defer:age_k=2``."""
        return self.order + "".join(f":{k}={_fmt(v)}" for k, v in sorted(self.settings().items()))

    __str__ = label

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        """A deployment config's dump writes the ``router.dispatch`` section it was read from
        (:meth:`to_config`), so a dumped config parses back to the same queue."""
        return self.to_config()

    def to_config(self) -> dict[str, Any]:
        """This spec as the router config's ``router.dispatch`` section (demo-live runs the
        router's queue as the simulator beside it does), every switch written: every order
        parameter (defaults filled in: the router merges a section over its own default's
        parameters), every readiness key, the bounds that were set, and the two link rules
        (null: off)."""
        if self.replicas != 1:
            raise ValueError(
                "dispatch: replicas are router processes live (launch.router.replicas), not a queue setting"
            )
        prio = {"sglang_priority": True} if self.sglang_priority else {}
        if self.order == "immediate":
            return {"order": "immediate", **prio}
        rd = {k: (None if v == math.inf else v) for k, v in dict(self.readiness).items()}
        if rd["mode"] == "fixed":
            del rd["slo_k"], rd["slo_q"], rd["slo_window"]
        out: dict[str, Any] = {"order": self.order, "params": self.order_params, "readiness": rd, **prio}
        for k in BOUND_KEYS:  # null written out too: unbounded, over the router's bounded default
            out[k] = getattr(self, k)
        if "replica_mode" in self.named:
            out["replica_mode"] = self.replica_mode
        for k in (BYPASS_KEY, AFFINITY_KEY):
            v = getattr(self, k)
            out[k] = None if v == math.inf else v
        return out

    # ------------------------------------------------------------------ building
    @property
    def order_params(self) -> dict[str, float]:
        """All of the order's own parameters, its defaults filled in."""
        return self._order().params()

    @property
    def priority(self) -> bool:
        """``sglang_priority`` (the text form's ``prio``)."""
        return self.sglang_priority

    def _order(self) -> Order:
        cls = ORDERS[_check_order(self.order)]
        try:
            return cls(**self.params)
        except TypeError:
            own = ", ".join(self.params)
            raise ValueError(f"dispatch order {self.order!r} takes no parameter(s) {own}") from None

    def build(self, refusals: Refusals | None = None) -> Dispatcher:
        """A fresh :class:`Dispatcher` for this spec (one per router replica); ``refusals``:
        the memory of requests refused for their wait that router replicas share (None: its
        own, :mod:`stack.dispatch.refusals`). Raises
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
            max_wait_k=self.max_wait_k,
            replica_mode=self.replica_mode if "replica_mode" in self.named else None,
            bypass=rules[BYPASS_KEY],
            affinity=rules[AFFINITY_KEY],
            refusals=refusals,
        )

    def validate(self) -> DispatchSpec:  # type: ignore[override]
        """This spec, if it builds (see :meth:`build`)."""
        self.build()
        return self


def key_help() -> str:
    """Every readiness and queue key of the text form with its meaning and the simulator's
    default, from the model's field descriptions (``--dispatch-param``'s help)."""
    parts = []
    fields = {**Readiness.model_fields, **DispatchSpec.model_fields}
    for key in (*READINESS_KEYS, *_QUEUE_KEYS):
        f = fields[key]
        name = _LABEL_KEY.get(key, key)
        name = f"{name} ({key})" if name != key else key
        d = f.get_default(call_default_factory=True)
        if key == "replica_mode":
            shown = "own; live, claims with Redis"
        elif isinstance(d, bool):
            shown = str(int(d))
        else:
            shown = "off" if d is None or d == math.inf else (f"{d:g}" if isinstance(d, float) else str(d))
        parts.append(f"{name}: {f.description} [default {shown}]")
    return "; ".join(parts)


#: the simulator's default: no queue; an order named without a threshold runs at T = 2 s
SIM_DISPATCH = DispatchSpec()
#: the router's default (``router.dispatch``): deadline-defer (age_k 1.5, aged_share 0.125, no
#: slack stealing; far_k 5: the requests that can still stay under 5x SLO go first among
#: those that missed it), readiness from the traffic's SLOs (T = 0.5 x their median, 4 s before the first),
#: the fetch as lead time where an instance's link backlog is at least its own queued prefill
#: (``lead_queue``; issue 48's protocol chose it: docs/research/dispatch.md), and both link rules at share 1
#: (``bypass``, ``affinity``): docs/research/dispatch.md, "The default". A bounded wait: a request
#: leaves the queue within 5x its own SLO (where the figures count it lost: ``far_k``) and
#: within 30 s (half the 60 s idle timeout common to load balancers, so that its prefill
#: still fits), or gets the overload answer; set by those definitions, not tuned on a result
ROUTER_DISPATCH = SIM_DISPATCH.updated(
    "deadline-defer",
    {"age_k": 1.5, "aged_share": 0.125, "far_k": 5.0, "T": 4.0, "slo_k": 0.5, "lead_queue": 1.0,
     BYPASS_KEY: 1.0, AFFINITY_KEY: 1.0, "max_wait_k": 5.0, "max_queue_wait_s": 30.0},
).validate()  # fmt: skip


def make_dispatcher(spec: DispatchSpec | str = SIM_DISPATCH, **values: float) -> Dispatcher:
    """Build the dispatcher of ``spec``; an order's name with ``values`` (text-form keys,
    e.g. ``make_dispatcher("fifo", T=1)``) is the simulator's spec of that order."""
    if isinstance(spec, str):
        spec = SIM_DISPATCH.updated(spec, values)
    elif values:
        spec = spec.updated(None, values)
    return spec.build()
