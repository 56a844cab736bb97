"""Prefill and decode cost models and their calibrations (kept as data in configs/hardware/).

``cost(n, L) = c_linear * n + c_attn * n * (L - n / 2) + c_fwd``: seconds to prefill ``n``
new tokens whose context ends at ``L`` (attention over the cached prefix counts).
An engine whose attention kernel recomputes the cached prefix's own queries (SGLang's
``torch_native`` backend on CPU) adds ``c_prefix * (L - n)**2 / 2``; ``c_prefix`` is 0 for the
GPU kernels (and for every shipped calibration).

``DecodeCost.step(B, C)``: seconds of one decode forward carrying ``B`` running requests
whose contexts sum to ``C`` tokens (PD colocation, ``smetric sim --mode colocated``).

``HandoffCost.seconds(L, ...)``: in a PD pool, the seconds between the end of a prompt's
prefill and the client's first token: the decode worker's bootstrap with the prefill worker,
the KV transfer of the ``L`` prompt tokens, the decode worker's first forward and the HTTP
hops of the PD path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from stack.paths import configs_dir


@dataclass(frozen=True, slots=True)
class CostModel:
    c_linear: float = 4.4e-5
    c_attn: float = 6.0e-9
    c_fwd: float = 0.025
    #: seconds per (cached prefix token)^2 / 2: attention recomputed over the prefix (0: not)
    c_prefix: float = 0.0

    def cost(self, n: float, L: float) -> float:
        """Seconds to prefill ``n`` new tokens ending at context length ``L``."""
        if n <= 0:
            return 0.0
        p = L - n
        return self.c_linear * n + self.c_attn * n * (L - 0.5 * n) + self.c_prefix * 0.5 * p * p + self.c_fwd

    def chunk(self, n: float, end: float) -> float:
        """Compute time of one chunk of ``n`` tokens ending at ``end`` (no per-forward overhead)."""
        p = end - n
        return self.c_linear * n + self.c_attn * n * (end - 0.5 * n) + self.c_prefix * 0.5 * p * p


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """One decode forward: ``d_fwd + d_experts * (1 - (1 - expert_share) ** B) + d_ctx * C``.

    Decode is memory-bound: ``d_fwd`` reads the dense weights and runs the attention
    kernels' fixed part; the MoE layers read the weights of the experts the batch's tokens
    select (``expert_share`` = top-k / experts per token, so a batch touches the expected
    share ``1 - (1 - expert_share) ** B`` of ``d_experts``, all experts' weight read);
    attention reads every running request's KV (``d_ctx`` seconds per context token).
    In a mixed forward (prefill chunks plus decodes, SGLang's chunked prefill with mixed
    batches) the prefill forward already reads every weight, so the decodes add only their
    tokens' linear cost and their attention: :meth:`mixed_extra`.
    """

    d_fwd: float = 2.1e-3
    d_experts: float = 0.018
    expert_share: float = 0.0625
    d_ctx: float = 3.48e-8

    def base(self, batch: int) -> float:
        """Seconds of a decode forward of ``batch`` requests, attention over context aside."""
        if batch <= 0:
            return 0.0
        return self.d_fwd + self.d_experts * (1.0 - (1.0 - self.expert_share) ** batch)

    def step(self, batch: int, context: float) -> float:
        """Seconds of one decode-only forward of ``batch`` requests over ``context`` tokens."""
        if batch <= 0:
            return 0.0
        return self.base(batch) + self.d_ctx * context

    def mixed_extra(self, batch: int, context: float, c_linear: float) -> float:
        """Seconds ``batch`` decodes over ``context`` tokens add to a prefill forward."""
        if batch <= 0:
            return 0.0
        return c_linear * batch + self.d_ctx * context


def quantile_at(q: tuple[float, ...], u: float) -> float:
    """The value at probability ``u`` in [0, 1] of a distribution given as its quantiles ``q``
    at evenly spaced probabilities from 0 to 1 (at least two), linear between them."""
    x = u * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    return q[i] + (q[i + 1] - q[i]) * (x - i)


@dataclass(frozen=True, slots=True)
class HandoffCost:
    """The PD hand-off: what a request waits between its prefill's last forward and its first
    token at the client, beyond the prefill itself.

    ``seconds(L) = bootstrap_s + L * kv_bytes_per_token * 8 / (transfer_gbps * 1e9)
    + [decode.step(1, L) if first_step] + hop_s``.

    Every term is 0 (off) in the shipped GPU calibrations (h20, h200) until measured on a GPU;
    ``smetric calibrate --handoff ROUTER`` measures them on a PD pair. A fit from client-side
    timings cannot tell the fixed terms apart, nor the KV transfer from the other per-token
    costs of the path (the first step's attention, the prompt's parse): it writes the fixed
    part as ``bootstrap_s`` and the per-token part as ``transfer_gbps``, the rate that would
    explain all of it.
    """

    #: fixed seconds per hand-off on the engines: the decode worker's bootstrap handshake with
    #: the prefill worker and its scheduling of the request
    bootstrap_s: float = 0.0
    #: the KV moves from the prefill to the decode worker at this rate (Gbit/s); 0: not charged
    transfer_gbps: float = 0.0
    #: charge the decode worker's first forward (``decode.step(1, L)``)
    first_step: bool = False
    #: seconds the HTTP hops of the PD path add, once per request (client to router to the
    #: decode worker and back); the emulator leaves it out (its hops are real)
    hop_s: float = 0.0
    #: how far one request's hand-off lies from ``seconds(L)``: the quantiles, at evenly spaced
    #: probabilities from 0 to 1, of the measured deviations (seconds, either sign); the
    #: simulator draws one per request (:meth:`drawn`). Empty: every hand-off is ``seconds(L)``.
    spread_s: tuple[float, ...] = ()
    #: the prefill worker hands a finished prefill over only between its forwards: SGLang's PD
    #: prefill loop checks its KV transfers once per pass, after the pass's forward, so a
    #: prefill whose transfer is still in flight when the worker starts its next forward (work
    #: was waiting) is handed over at that forward's end, and its first token waits with it
    between_forwards: bool = False

    def engine_seconds(self, L: float, kv_bytes_per_token: int, decode: DecodeCost) -> float:
        """The engines' part of the hand-off (every term but ``hop_s``)."""
        s = self.bootstrap_s
        if self.transfer_gbps > 0:
            s += L * kv_bytes_per_token * 8.0 / (self.transfer_gbps * 1e9)
        if self.first_step:
            s += decode.step(1, L)
        return s

    def seconds(self, L: float, kv_bytes_per_token: int, decode: DecodeCost) -> float:
        """Seconds the hand-off adds to the time to first token of an ``L``-token prompt."""
        return self.engine_seconds(L, kv_bytes_per_token, decode) + self.hop_s

    def drawn(self, L: float, kv_bytes_per_token: int, decode: DecodeCost, u: float) -> float:
        """``seconds(L)`` moved by the ``spread_s`` quantile at ``u`` in [0, 1) (linear between
        the listed quantiles), never below 0."""
        s = self.seconds(L, kv_bytes_per_token, decode)
        return max(0.0, s + quantile_at(self.spread_s, u)) if len(self.spread_s) >= 2 else s

    @property
    def off(self) -> bool:
        return not (
            self.bootstrap_s
            or self.transfer_gbps
            or self.first_step
            or self.hop_s
            or self.spread_s
            or self.between_forwards
        )


@dataclass(frozen=True, slots=True)
class Hardware:
    """A GPU + model calibration: cost model, HBM room for KV, chunked-prefill budget."""

    name: str
    cost: CostModel
    hbm_kv_tokens: int
    chunk_tokens: int
    kv_bytes_per_token: int
    gpus_per_server: int = 8
    nic_gbps: float = 200.0
    link_efficiency: float = 0.8
    decode_tpot_s: float = 0.02
    description: str = ""
    decode: DecodeCost = DecodeCost()
    handoff: HandoffCost = HandoffCost()

    def handoff_s(self, L: float) -> float:
        """Seconds the PD hand-off adds to an ``L``-token prompt's time to first token (its
        typical value: the spread left out)."""
        return self.handoff.seconds(L, self.kv_bytes_per_token, self.decode)

    def handoff_drawn(self, L: float, u: float) -> float:
        """One request's hand-off: :meth:`handoff_s` moved by the spread's quantile at ``u``."""
        return self.handoff.drawn(L, self.kv_bytes_per_token, self.decode, u)

    def link_tokens_per_s(self, shared_nic: bool) -> float:
        """Fetch bandwidth of one instance's link in tokens/s (one NIC per GPU or shared)."""
        bytes_per_s = self.nic_gbps * 1e9 / 8 * self.link_efficiency
        return bytes_per_s / self.kv_bytes_per_token


def hardware_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    return configs_dir() / "hardware" / f"{name}.yaml"


def load_hardware(name: str = "h20") -> Hardware:
    """Load a calibration by short name (``h20``, ``h200``) or YAML path."""
    path = hardware_path(name)
    if not path.exists():
        known = sorted(q.stem for q in (configs_dir() / "hardware").glob("*.yaml"))
        raise ValueError(f"unknown hardware calibration {name!r} (known: {', '.join(known)})")
    data = yaml.safe_load(path.read_text())
    c = data["cost"]
    d = data.get("decode") or {}
    dflt = DecodeCost()
    decode = DecodeCost(
        float(d.get("d_fwd", dflt.d_fwd)),
        float(d.get("d_experts", dflt.d_experts)),
        float(d.get("expert_share", dflt.expert_share)),
        float(d.get("d_ctx", dflt.d_ctx)),
    )
    h = data.get("handoff") or {}
    handoff = HandoffCost(
        float(h.get("bootstrap_s", 0.0)),
        float(h.get("transfer_gbps", 0.0)),
        bool(h.get("first_step", False)),
        float(h.get("hop_s", 0.0)),
        tuple(float(x) for x in h.get("spread_s") or ()),
        bool(h.get("between_forwards", False)),
    )
    return Hardware(
        name=data.get("name", path.stem),
        cost=CostModel(
            float(c["c_linear"]), float(c["c_attn"]), float(c["c_fwd"]), float(c.get("c_prefix", 0.0))
        ),
        hbm_kv_tokens=int(data["hbm_kv_tokens"]),
        chunk_tokens=int(data.get("chunk_tokens", 8192)),
        kv_bytes_per_token=int(data.get("kv_bytes_per_token", 98304)),
        gpus_per_server=int(data.get("gpus_per_server", 8)),
        nic_gbps=float(data.get("nic_gbps", 200.0)),
        link_efficiency=float(data.get("link_efficiency", 0.8)),
        decode_tpot_s=float(data.get("decode_tpot_s", 0.02)),
        description=str(data.get("description", "")),
        decode=decode,
        handoff=handoff,
    )


def hardware_dict(hw: Hardware) -> dict:
    """``hw`` as a calibration file's mapping (the keys :func:`load_hardware` reads)."""
    c, d, h = hw.cost, hw.decode, hw.handoff
    return {
        "name": hw.name,
        "description": hw.description,
        "cost": {
            "c_linear": c.c_linear,
            "c_attn": c.c_attn,
            "c_fwd": c.c_fwd,
            **({"c_prefix": c.c_prefix} if c.c_prefix else {}),
        },
        "hbm_kv_tokens": hw.hbm_kv_tokens,
        "chunk_tokens": hw.chunk_tokens,
        "kv_bytes_per_token": hw.kv_bytes_per_token,
        "gpus_per_server": hw.gpus_per_server,
        "nic_gbps": hw.nic_gbps,
        "link_efficiency": hw.link_efficiency,
        "decode_tpot_s": hw.decode_tpot_s,
        "decode": {
            "d_fwd": d.d_fwd,
            "d_experts": d.d_experts,
            "expert_share": d.expert_share,
            "d_ctx": d.d_ctx,
        },
        "handoff": {
            "bootstrap_s": h.bootstrap_s,
            "transfer_gbps": h.transfer_gbps,
            "first_step": h.first_step,
            "hop_s": h.hop_s,
            **({"spread_s": [round(x, 6) for x in h.spread_s]} if h.spread_s else {}),
            **({"between_forwards": True} if h.between_forwards else {}),
        },
    }


def dump_hardware(hw: Hardware, header: str = "", extra: dict | None = None) -> str:
    """A calibration file's text for ``hw`` (``--hardware FILE`` takes it): ``header`` as
    comment lines on top, ``extra`` (e.g. the provenance of a fit) as more keys, which
    :func:`load_hardware` ignores."""
    data = hardware_dict(hw)
    if extra:
        data.update(extra)
    lines = [f"# {line}".rstrip() for line in header.splitlines()] if header else []
    return "\n".join(lines + [yaml.safe_dump(data, sort_keys=False, width=100).rstrip()]) + "\n"


class SwitchableCost:
    """A prefill cost model whose coefficients can be swapped at run time (the router's
    ``router.cost_model: learn``: the configured calibration until a learned fit is trusted).

    It answers what a :class:`CostModel` answers (``cost``, ``chunk``, the coefficients),
    always from the model :meth:`use` last installed; whoever holds it (the policy's TTFT
    estimate, the view builder's queued seconds, the dispatch queue) sees a switch at once.
    """

    __slots__ = ("_m",)

    def __init__(self, model: CostModel) -> None:
        self._m = model

    def use(self, model: CostModel) -> None:
        self._m = model

    # methods, not attributes: a holder that binds ``x.cost`` once (the policies do) still
    # reads the model in use at each call
    def cost(self, n: float, L: float) -> float:
        return self._m.cost(n, L)

    def chunk(self, n: float, end: float) -> float:
        return self._m.chunk(n, end)

    @property
    def model(self) -> CostModel:
        return self._m

    @property
    def c_linear(self) -> float:
        return self._m.c_linear

    @property
    def c_attn(self) -> float:
        return self._m.c_attn

    @property
    def c_fwd(self) -> float:
        return self._m.c_fwd

    @property
    def c_prefix(self) -> float:
        return self._m.c_prefix
