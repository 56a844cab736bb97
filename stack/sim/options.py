"""The options of one simulated (or replayed) run, built and validated in one place.

``smetric sim``, ``smetric bench`` (and ``smetric demo`` through it) and ``smetric replay``
all describe a run by the same cluster and load options. :class:`SimOptions` holds them
as typed values; the drivers build it from their command line (:meth:`SimOptions.from_args`)
or from a mapping (:meth:`SimOptions.from_mapping`), and only its methods turn it into the
simulator's :class:`~stack.sim.engine.SimConfig` and :class:`~stack.sim.load.LoadSpec`, so
every command validates the same values with the same messages and resolves the load
mode ``auto`` by the same rule (:func:`~stack.sim.load.resolve_load_mode`).

Validation happens where the options are turned into a config or a load (not when they
are built), so a bench setting that overrides a base value is judged on the value it
actually runs with.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stack.core.cost_model import load_hardware
from stack.core.types import SLO
from stack.dispatch import SIM_DISPATCH, DispatchSpec
from stack.dispatch.spec import parse_items
from stack.paths import default_trace
from stack.sim.clients import ClientModel
from stack.sim.engine import GlobalTierSpec, SimConfig
from stack.sim.load import LoadSpec, resolve_load_mode
from stack.traces.load import load_trace
from stack.traces.model import Trace


def parse_params(items: Iterable[str]) -> dict[str, object]:
    """``--param KEY=VALUE`` items as policy keyword arguments: numbers become floats
    (``inf``/``infinity`` too), ``true``/``false`` (any case) booleans, anything else stays
    text; dashes in keys become underscores. (``"false"`` as text would be truthy.)"""
    out: dict[str, object] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        try:
            val: object = float(v)
            if val == math.inf or v.strip() in ("inf", "infinity"):
                val = math.inf
        except ValueError:
            low = v.strip().lower()
            val = True if low == "true" else False if low == "false" else v
        out[k] = val
    return out


# command-line destinations whose option name differs from the field's
_ARG_FIELDS = {"format": "fmt"}


@dataclass(frozen=True)
class SimOptions:
    """Cluster and load options of a run (picklable, so bench worker processes get it).

    Defaults are the command line's. ``slo_a`` is in seconds per 1k prompt tokens, as on
    the command line; ``params`` are the policy's keyword arguments (``--param``).
    """

    # trace
    trace: str = field(default_factory=lambda: str(default_trace()))
    fmt: str = "auto"
    shared_prefix: bool = False  # agentic: tools + system prompt blocks shared across sessions
    # load
    load_mode: str = "auto"
    rate_scale: float = 1.0
    session_rate: float | None = None
    duration: float = 28800.0
    warmup: float | None = None
    seed: int = 0
    max_think: float | None = None
    #: the same load perturbed (:attr:`~stack.sim.load.LoadSpec.perturb`): the chaos floor's
    #: replays, and ``smetric advise``'s seeds in compress mode; None: as recorded
    perturb: int | None = None
    # cluster
    instances: int = 32
    hardware: str = "h20"
    hbm_tokens: int | None = None
    chunk_tokens: int | None = None
    global_tier: str = "full"
    link: str = "per-gpu"
    match_at: str = "arrival"
    global_write: str = "instant"
    slo_b: float = 1.0
    slo_a: float = 0.0625
    slo_tpot: float = 0.020  # seconds per output token (scored in colocated mode)
    # pd (prefill instances, decode elsewhere) | colocated (prefill + decode per instance)
    mode: str = "pd"
    decode_steps: str = "aggregate"  # colocated: aggregate | step (one event per forward)
    params: dict[str, Any] = field(default_factory=dict)
    # dispatch (stack/dispatch): the order, its parameters, readiness, bounds and replicas
    # (--dispatch, --dispatch-param); bench applies its axis' orders over this one's values
    dispatch: DispatchSpec = SIM_DISPATCH
    # clients that time out and retry (stack/sim/clients.py): off unless ``clients``
    clients: bool = False
    client_patience: float = 600.0
    client_retries: int = 2

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SimOptions:
        """From field names to values; a name that is no field raises ``ValueError`` (a
        typo would otherwise silently run with the default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown simulation option(s): {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimOptions:
        """From a parsed command line. Only the options the command defines are taken (a
        command without cluster options, such as replay, gets the defaults for those);
        ``--param`` items are parsed into ``params``, ``--dispatch`` and ``--dispatch-param``
        into ``dispatch`` (over the simulator's default, :data:`~stack.dispatch.SIM_DISPATCH`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for dest, value in vars(args).items():
            name = _ARG_FIELDS.get(dest, dest)
            if name in names and name not in ("params", "dispatch"):
                values[name] = value
        if "trace" in values:
            values["trace"] = str(values["trace"])
        if "shared_prefix" in values:
            values["shared_prefix"] = bool(values["shared_prefix"])
        if getattr(args, "param", None) is not None:
            values["params"] = parse_params(args.param)
        order = getattr(args, "dispatch", None)
        items = getattr(args, "dispatch_param", None)
        if order is not None or items:
            values["dispatch"] = SIM_DISPATCH.updated(order, parse_items(items or (), "--dispatch-param"))
        return cls(**values)

    def override(self, **changes: Any) -> SimOptions:
        """A copy with ``changes`` applied; ``None`` keeps the current value (a bench
        setting overrides only what it names)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    # ------------------------------------------------------------------ products
    def slo(self) -> SLO:
        """The TTFT SLO (``slo_a`` converted to seconds per token), validated."""
        return SLO(b=self.slo_b, a=self.slo_a / 1000.0, tpot=self.slo_tpot).validate()

    def sim_config(self, policy_params: dict | None = None) -> SimConfig:
        """The validated cluster configuration (:meth:`SimConfig.validate`); ``policy_params``
        replace ``params``."""
        hw = load_hardware(self.hardware)
        cfg = SimConfig(
            instances=self.instances,
            hardware=hw,
            global_tier=GlobalTierSpec.parse(self.global_tier, hw.kv_bytes_per_token),
            link=self.link,
            slo=self.slo(),
            hbm_tokens=self.hbm_tokens,
            chunk_tokens=self.chunk_tokens,
            match_at=self.match_at,
            global_write=self.global_write,
            dispatch=self.dispatch,
            mode=self.mode,
            decode_steps=self.decode_steps,
            policy_params=policy_params if policy_params is not None else dict(self.params),
            clients=self.client_model(),
        )
        cfg.validate()
        return cfg

    def client_model(self) -> ClientModel | None:
        """The client model (``--clients``), or None."""
        return ClientModel(self.client_patience, self.client_retries) if self.clients else None

    def resolved_mode(self, trace: Trace) -> str:
        """``load_mode`` with ``auto`` resolved for ``trace``."""
        return resolve_load_mode(trace, self.load_mode)

    def load_spec(self, trace: Trace, rate: float | None = None) -> LoadSpec:
        """The validated load on ``trace``. ``rate`` (a bench sweep's point) replaces the
        rate options: session starts per second in sessions mode, the time compression in
        compress mode."""
        mode = self.resolved_mode(trace)
        if rate is None:
            session_rate, rate_scale = self.session_rate, self.rate_scale
        else:
            session_rate = rate if mode == "sessions" else None
            rate_scale = rate if mode == "compress" else 1.0
        spec = LoadSpec(
            mode=mode,
            session_rate=session_rate,
            rate_scale=rate_scale,
            duration=self.duration,
            warmup=self.warmup,
            seed=self.seed,
            max_think=self.max_think,
            perturb=self.perturb,
        )
        spec.validate()
        return spec

    def read_trace(self) -> Trace:
        return load_trace(self.trace, fmt=self.fmt, shared_prefix=self.shared_prefix)
