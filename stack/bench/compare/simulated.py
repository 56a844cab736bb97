"""The simulator's side of ``smetric compare``: our policies as themselves, sglang-router's
through their closest counterpart in the simulator (an approximation, said with the results)."""

from __future__ import annotations

import argparse

from stack.bench.live import simulate_pool

# sglang-router policy -> (simulator policy: a name of ours or of a stand-in such as
# "sglang-cache-aware~" (stack/policies/sglang_cache_aware.py), its parameters,
# how close it is)
SIM_COUNTERPARTS: dict[str, tuple[str, dict, str]] = {
    "round_robin": ("round-robin", {}, "same rule"),
    "cache_aware": (
        "random",
        {},
        "what 0.3.2 does in PD mode: it logs 'No tree found for model ..., using random worker "
        "selection' for every prefill and decode choice (docs/research/results.md); the approximate-tree "
        "stand-in sglang-cache-aware~ models the policy as designed",
    ),
    "random": ("random", {}, "same rule"),
    "power_of_two": (
        "linear",
        {"lam": 0.0},
        "approximation: with 2 prefill workers both are sampled, so it is join-the-shortest-queue on "
        "in-flight requests (linear with lam=0)",
    ),
}


def sim_counterpart(router: str, policy: str) -> tuple[str | None, dict, str]:
    """(simulator policy or None, its parameters, how close it is) for one configuration."""
    if router == "smetric":
        return policy, {}, "same policy object"
    if policy in SIM_COUNTERPARTS:
        return SIM_COUNTERPARTS[policy]
    return None, {}, "no sim counterpart"


def sim_run(
    args: argparse.Namespace, policy: str, params: dict, trace, hardware: str, hbm: int | None
) -> dict:
    # a policy of ours, or a stand-in for sglang-router's (policies.STAND_INS), by name
    return simulate_pool(args, trace, policy, hardware or "h20", hbm, policy_params=dict(params))
