"""Named experiments of `smetric bench`: which policies, over which cluster settings.

An experiment is a list of :class:`Setting` (cluster / SLO / policy-parameter overrides on
top of the command line) and a default policy list. Every (policy, setting) pair gets a
rate sweep: the rates given with ``--rates``, or a search for the peak of its
TPS-within-SLO curve. The experiments mirror the paper's evaluation (§5):

- ``pd-disagg``: the main comparison (§5.3, Fig. 21-23): all policies, default cluster.
- ``global-tier``: no global tier / sized / fully provisioned, and the link: one 200 Gbps
  NIC per GPU or one NIC shared by a server's 8 GPUs (Fig. 22: the paper does not say).
- ``slo``: sensitivity to the SLO's fixed budget b and per-token budget a (Fig. 24).
- ``hyper``: SMetric's SLACK (0.5-2, plus the degenerate 0 and inf) and HIT_RATIO (Fig. 26).
- ``ablation``: the order of Fig. 25: basic session-centric, + load-threshold migration,
  + SLO migration on token counts, + SLO migration on the cost model (faithful SMetric).
- ``scale``: 8 to 128 instances (rates scaled with the cluster size).
- ``local-tier`` (ours): the local KV room per instance, 200k tokens (H20) to 8M (HBM plus
  an instance-local host-memory tier), x the link: session-centric routing needs room for
  sessions, and local hits only pay off when global fetches are slow.
- ``colocation``: PD colocation (§5.2, Fig. 14-18): every instance prefills and decodes,
  scored by output TPS within both the TTFT and the TPOT SLO, with the global tier fully
  provisioned (the paper's headline setting), sized (256 GB) and absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stack.policies import POLICIES, is_smetric

# the schedulers the paper compares (§5.2-5.3), plus our SMetric variants
MAIN_POLICIES: tuple[str, ...] = (
    "smetric",
    "smetric-global",
    "smetric-b",
    "lmetric",
    "linear",
    "least-load",
    "dynamo",
    "preble",
    "session",
    "slo-predictor",
)
CORE_POLICIES: tuple[str, ...] = ("smetric", "smetric-global", "lmetric", "linear", "least-load", "dynamo")


@dataclass(frozen=True)
class Setting:
    """One cluster setting: overrides of the command-line cluster options.

    ``params`` go to SMetric-family policies only (baselines keep their documented
    defaults). ``rate_factor`` multiplies every swept rate (the scale experiment keeps
    the load per instance comparable). ``policies`` restricts the setting to some policies.
    """

    label: str = "default"
    instances: int | None = None
    global_tier: str | None = None
    link: str | None = None
    slo_b: float | None = None
    slo_a: float | None = None  # seconds per 1k prompt tokens, as on the command line
    hbm_tokens: int | None = None
    params: dict = field(default_factory=dict)
    rate_factor: float = 1.0
    policies: tuple[str, ...] | None = None
    mode: str | None = None  # pd | colocated (None: the command line's --mode)

    def applies_to(self, policy: str) -> bool:
        return self.policies is None or policy in self.policies

    def params_for(self, policy: str, base: dict) -> dict:
        if is_smetric(policy):
            return {**base, **self.params}
        return dict(base) if _baseline_params_ok(policy, base) else {}

    def columns(self) -> dict:
        """The setting's CSV columns (None = the command line's value)."""
        return {
            "setting": self.label,
            "setting_params": ";".join(f"{k}={v}" for k, v in sorted(self.params.items())),
        }


def _baseline_params_ok(policy: str, params: dict) -> bool:
    # --param values are SMetric parameters unless a baseline knows them
    known = {"linear": {"lam"}, "dynamo": {"overlap_weight"}, "preble": {"spread", "match_ratio"}}
    return set(params) <= known.get(policy, set())


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    settings: tuple[Setting, ...]
    policies: tuple[str, ...] = MAIN_POLICIES


def _global_tier() -> tuple[Setting, ...]:
    out = [Setting("none", global_tier="none")]
    for size in ("256GB", "1TB", "full"):
        for link in ("per-gpu", "shared"):
            out.append(Setting(f"{size}/{link}", global_tier=size, link=link))
    return tuple(out)


def _slo() -> tuple[Setting, ...]:
    out = [Setting(f"b={b:g}", slo_b=b) for b in (0.5, 1.0, 2.0, 4.0)]
    out += [Setting(f"a={a:g}ms", slo_a=a / 1000.0) for a in (31.25, 125.0)]
    return tuple(out)


def _hyper() -> tuple[Setting, ...]:
    out = [Setting(f"slack={s:g}", params={"slack": s}) for s in (0.0, 0.5, 1.0, 1.5, 2.0, math.inf)]
    out += [Setting(f"hit_ratio={h:g}", params={"hit_ratio": h}) for h in (0.5, 0.9, 1.0)]
    return tuple(out)


def _local_tier() -> tuple[Setting, ...]:
    out = []
    for link in ("per-gpu", "shared"):
        for t, n in (("200k", 200_000), ("2M", 2_000_000), ("8M", 8_000_000)):
            out.append(Setting(f"hbm={t}/{link}", hbm_tokens=n, link=link))
    return tuple(out)


def _colocation() -> tuple[Setting, ...]:
    return tuple(
        Setting(f"colocated/{gt}", global_tier=gt, mode="colocated") for gt in ("full", "256GB", "none")
    )


# the paper's colocation comparison (§5.2): SMetric against LMetric, Bailian, llm-d's
# session and SLO schedulers, Preble, and our load-balance / Dynamo baselines
COLOCATION_POLICIES: tuple[str, ...] = (
    "smetric", "smetric-global", "lmetric", "bailian", "least-load", "dynamo", "preble", "session",
    "slo-predictor",
)  # fmt: skip


def _scale() -> tuple[Setting, ...]:
    return tuple(Setting(f"n={n}", instances=n, rate_factor=n / 32.0) for n in (8, 16, 32, 64, 128))


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment("pd-disagg", "main comparison under PD disaggregation (paper §5.3)", (Setting(),), MAIN_POLICIES),
        Experiment("global-tier", "global tier none / sized / full x link per-GPU / shared (Fig. 22)", _global_tier(), CORE_POLICIES + ("smetric-b", "session")),
        Experiment("slo", "sensitivity to the SLO's b and a (Fig. 24)", _slo(), CORE_POLICIES),
        Experiment("hyper", "SMetric SLACK and HIT_RATIO (Fig. 26)", _hyper(), ("smetric", "smetric-global")),
        Experiment("ablation", "ablation in the order of Fig. 25", (Setting(),), ("smetric-basic", "smetric-load", "smetric-tokens", "smetric", "session")),
        Experiment("scale", "8 to 128 instances", _scale(), CORE_POLICIES),
        Experiment("local-tier", "local KV room per instance 200k (H20) / 2M / 8M tokens (HBM + host tier) x link", _local_tier(), CORE_POLICIES + ("session",)),
        Experiment("colocation", "PD colocation, TPS within TTFT and TPOT SLOs, global tier full / 256GB / none (paper §5.2)", _colocation(), COLOCATION_POLICIES),
    )
}  # fmt: skip


def get_experiment(name: str) -> Experiment:
    e = EXPERIMENTS.get(name)
    if e is None:
        raise ValueError(f"unknown experiment {name!r} (known: {', '.join(EXPERIMENTS)})")
    return e


def split_policy(spec: str) -> tuple[str, str | None]:
    """``policy`` or ``policy+order[:k=v...]`` (a policy pinned to one dispatch order, as
    labelled in results) as ``(policy, order spec or None)``."""
    name, plus, order = spec.partition("+")
    return name.strip(), (order.strip() or None) if plus else None


def parse_policies(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """``all``, ``main``, ``core`` or a comma-separated list; unknown names are an error.
    An entry ``policy+order`` pins that policy to one dispatch order (instead of every
    order of ``--dispatch``)."""
    if text is None:
        return default
    t = text.strip()
    if t == "all":
        return POLICIES
    if t == "main":
        return MAIN_POLICIES
    if t == "core":
        return CORE_POLICIES
    names = [p.strip() for p in t.split(",") if p.strip()]
    if not names:
        raise ValueError("--policies: empty list")
    for spec in names:
        p, order = split_policy(spec)
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
        if order is not None:
            from stack.dispatch import DispatchSpec

            DispatchSpec.parse(order)  # ValueError on an unknown order or parameter
    return tuple(dict.fromkeys(names))


def select_settings(exp: Experiment, text: str | None) -> tuple[Setting, ...]:
    """``--settings``: a comma-separated subset of the experiment's setting labels."""
    if text is None:
        return exp.settings
    want = [t.strip() for t in text.split(",") if t.strip()]
    labels = [s.label for s in exp.settings]
    for w in want:
        if w not in labels:
            raise ValueError(f"--settings: {exp.name} has no setting {w!r} (known: {', '.join(labels)})")
    return tuple(s for s in exp.settings if s.label in want)


def parse_rates(text: str | None) -> list[float] | None:
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number") from None
        if not math.isfinite(r) or r <= 0:
            raise ValueError(f"--rates: every rate must be > 0, got {part!r}")
        out.append(r)
    if not out:
        raise ValueError("--rates: empty list")
    return sorted(set(out))
