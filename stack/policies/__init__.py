"""Routing policies behind one interface; ``make_policy(name, ctx, **params)``."""

from __future__ import annotations

from stack.policies.base import NoInstanceError, Policy, PolicyContext
from stack.policies.baselines import (
    Bailian,
    Dynamo,
    LeastLoad,
    Linear,
    LMetric,
    Preble,
    Random,
    RoundRobin,
    SessionAffinity,
)
from stack.policies.llmd import LLMDAgentic
from stack.policies.sglang_cache_aware import SGLangCacheAwareApprox
from stack.policies.slo_predictor import SLOPredictor
from stack.policies.smetric import VARIANTS as SMETRIC_VARIANTS
from stack.policies.smetric import SMetric, make_variant

_BASELINES: dict[str, type[Policy]] = {
    "linear": Linear,
    "bailian": Bailian,
    "lmetric": LMetric,
    "least-load": LeastLoad,
    "dynamo": Dynamo,
    "preble": Preble,
    "session": SessionAffinity,
    "slo-predictor": SLOPredictor,
    "llm-d-agentic": LLMDAgentic,
    "round-robin": RoundRobin,
    "random": Random,
}

POLICIES: tuple[str, ...] = SMETRIC_VARIANTS + tuple(_BASELINES)
BASELINES: tuple[str, ...] = tuple(_BASELINES)
# stand-ins for other routers' policies (`smetric compare`'s simulated counterparts): built
# by name, but not among POLICIES (our router's choices, `--policies all`)
STAND_INS: dict[str, type[Policy]] = {SGLangCacheAwareApprox.name: SGLangCacheAwareApprox}


def is_smetric(name: str) -> bool:
    return name.startswith("smetric")


def make_policy(name: str, ctx: PolicyContext, **params) -> Policy:
    """Build a policy by name. Unknown names raise ``ValueError`` listing the known ones."""
    cls = _BASELINES.get(name) or STAND_INS.get(name)
    if name not in SMETRIC_VARIANTS and cls is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    try:
        if name in SMETRIC_VARIANTS:
            return make_variant(name, ctx, **params)
        return cls(ctx, **params)
    except TypeError as e:
        raise ValueError(f"bad parameter for policy {name!r}: {e}") from None


__all__ = [
    "BASELINES",
    "POLICIES",
    "NoInstanceError",
    "Policy",
    "PolicyContext",
    "STAND_INS",
    "SMetric",
    "is_smetric",
    "make_policy",
]
