"""The simulator's configuration and result types.

:class:`SimConfig` is one simulated cluster (instances, calibration, KV tiers, SLO, the
router's queue, PD or colocated mode); :class:`GlobalTierSpec` the global KV tier's size;
:class:`SimResult` what a run returns. ``stack.sim.options`` builds a ``SimConfig`` from the
command line and the bench specs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stack.core.cost_model import Hardware, load_hardware
from stack.core.types import SLO
from stack.dispatch import SIM_DISPATCH, DispatchSpec
from stack.sim.clients import ClientModel


@dataclass(slots=True)
class GlobalTierSpec:
    """``mode``: none | full | sized (capacity in tokens)."""

    mode: str = "full"
    capacity_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | None, kv_bytes_per_token: int = 98304) -> GlobalTierSpec:
        """``none``, ``full``, or a size: tokens (``2M``, ``500k``) or bytes (``256GB``)."""
        if text is None or text == "full":
            return cls("full")
        if text == "none":
            return cls("none")
        t = text.strip().lower()
        units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
        try:
            if t.endswith(("gb", "tb", "mb", "kb", "gib", "tib", "mib")):
                num = t.rstrip("ib").rstrip("b")
                mult = units[num[-1]]
                if "i" in t:
                    mult = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[num[-1]]
                cap = float(num[:-1]) * mult / kv_bytes_per_token
            elif t[-1] in units:
                cap = float(t[:-1]) * units[t[-1]]
            else:
                cap = float(t)
        except (ValueError, KeyError, IndexError):
            raise ValueError(
                f"invalid global tier {text!r}: use none, full, a token count (2M) or a size (256GB)"
            ) from None
        if cap < 0 or math.isnan(cap):
            raise ValueError("global tier capacity must be >= 0")
        return cls("sized", int(cap))


@dataclass(slots=True)
class SimConfig:
    instances: int = 32
    hardware: Hardware = field(default_factory=lambda: load_hardware("h20"))
    global_tier: GlobalTierSpec = field(default_factory=GlobalTierSpec)
    link: str = "per-gpu"  # per-gpu | shared (one NIC per server)
    slo: SLO = field(default_factory=SLO)
    hbm_tokens: int | None = None  # override the calibration's HBM KV room
    chunk_tokens: int | None = None
    window_s: float = 30.0
    policy_params: dict = field(default_factory=dict)
    # when an instance matches its local prefix cache: at the request's arrival (the hit the
    # router saw; older behaviour), or when the request first enters a prefill batch, as
    # SGLang does (matched blocks are then locked until the request completes)
    match_at: str = "arrival"  # arrival | schedule
    # a completed prefill's KV reaches the global tier: at once, or after its write over the
    # instance's link (same FIFO as fetches; visible to lookups when the write is done)
    global_write: str = "instant"  # instant | link
    # the dispatcher between the policy and the instances (stack/dispatch): its order
    # ``immediate`` routes every request at its arrival (no queue at the router); the others
    # hold requests until an instance is ready and release them in their order; ``replicas``
    # router replicas share it as ``replica_mode`` says
    dispatch: DispatchSpec = SIM_DISPATCH
    # ``pd``: prefill instances only (decode in another pool); ``colocated``: each instance
    # also decodes its requests in the same forwards (stack/sim/colocated.py)
    mode: str = "pd"
    # colocated: advance running decodes over intervals of equal batch composition
    # (``aggregate``) or one event per decode forward (``step``, the reference)
    decode_steps: str = "aggregate"
    # clients that time out and retry (stack/sim/clients.py); None: every request waits for
    # its answer however long, and a refused one is not retried (the figures before it)
    clients: ClientModel | None = None

    def validate(self) -> None:
        """Raises ``ValueError`` on a bad setting (naming the ``smetric sim`` flag that sets it):
        the one place the cluster's settings are checked (:meth:`SimOptions.sim_config` builds
        a :class:`SimConfig` and calls this)."""
        if self.instances <= 0:
            raise ValueError("--instances must be > 0")
        if self.hbm_tokens is not None and self.hbm_tokens < 0:
            raise ValueError("--hbm-tokens must be >= 0")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ValueError("--chunk-tokens must be > 0")
        if self.link not in ("per-gpu", "shared"):
            raise ValueError("--link must be per-gpu or shared")
        self.slo.validate()
        if self.window_s <= 0:
            raise ValueError("window must be > 0")
        if self.match_at not in ("arrival", "schedule"):
            raise ValueError("match_at must be arrival or schedule")
        if self.global_write not in ("instant", "link"):
            raise ValueError("global_write must be instant or link")
        if self.mode not in ("pd", "colocated"):
            raise ValueError("mode must be pd or colocated")
        if self.decode_steps not in ("aggregate", "step"):
            raise ValueError("decode_steps must be aggregate or step")
        self.dispatch.validate()  # raises ValueError
        if self.clients is not None:
            self.clients.validate()


@dataclass(slots=True)
class SimResult:
    metrics: dict
    ttfts: list[float]  # measured requests, in completion order
    imbalance: list[float]  # per window
    per_request: list[tuple] | None = None
