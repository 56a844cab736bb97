"""Where each SGLang instance of a deployment runs: its node, GPUs and ports.

Placement is the one step both renderers need before anything else: the per-node launch
(``stack.launch.sglang``) turns each :class:`WorkerPlan` into a command, and the Kubernetes
renderer validates a config by placing it on the real nodes first. It depends only on the
config readers (``stack.launch.sglang_config``), so neither renderer has to import the other.
"""

from __future__ import annotations

from typing import Any

from stack.launch.sglang_config import (
    LaunchConfigError,
    as_dict,
    node_list,
    pool_settings,
    sglang_launch,
)
from stack.launch.spec import kv_replay_base

__all__ = ["WorkerPlan", "pools", "check_ports"]


class WorkerPlan(dict):
    """One SGLang instance: role, index, node, host, gpus, ports (a dict, for easy dumping)."""


def pools(config: Any) -> list[WorkerPlan]:
    """Place every prefill and decode instance on a node and its GPUs (prefill first).

    Instances of a pool fill its nodes in order, ``tp`` GPUs at a time from each node's free
    GPUs. On ``device: cpu`` GPUs are not counted (every instance fits anywhere; the pool's
    ``per_node`` cap, default 1 for CPU, spreads them).
    """
    cfg = as_dict(config)
    launch = sglang_launch(cfg)
    device = launch.get("device", "cuda")
    nodes = node_list(launch, device)
    by_name = {n["name"]: n for n in nodes}
    free = {n["name"]: list(n["gpu_ids"]) for n in nodes}
    local_index: dict[tuple[str, str], int] = {}
    plans: list[WorkerPlan] = []
    for role in ("prefill", "decode"):
        pool = pool_settings(launch, role)
        names = pool.get("nodes") or [n["name"] for n in nodes]
        for nm in names:
            if nm not in by_name:
                raise LaunchConfigError(f"launch.{role}.nodes: unknown node {nm!r}")
        per_node = pool.get("per_node")
        placed = 0
        for nm in names:
            node = by_name[nm]
            on_this = 0
            while placed < pool["count"]:
                if per_node is not None and on_this >= per_node:
                    break
                if device == "cpu":
                    gpus: list[int] = []
                else:
                    if len(free[nm]) < pool["tp"]:
                        break
                    gpus, free[nm] = free[nm][: pool["tp"]], free[nm][pool["tp"] :]
                k = local_index.get((nm, role), 0)
                local_index[(nm, role)] = k + 1
                stride = int(pool.get("port_stride", launch.get("port_stride", 10)))
                plan = WorkerPlan(
                    role=role,
                    index=placed,
                    name=f"{role}-{placed}",
                    node=nm,
                    host=node["host"],
                    gpus=gpus,
                    port=int(pool["port"]) + k * stride,
                    local_index=k,
                )
                if role == "prefill":
                    plan["bootstrap_port"] = int(pool["bootstrap_port"]) + k * stride
                if pool.get("kv_events_port") is not None:
                    plan["kv_events_port"] = int(pool["kv_events_port"]) + k * stride
                    replay = kv_replay_base(pool, stride)
                    if replay is not None:
                        plan["kv_replay_port"] = replay + k * stride
                plans.append(plan)
                placed += 1
                on_this += 1
        if placed < pool["count"]:
            have = sum(len(free[n]) for n in names)
            raise LaunchConfigError(
                f"launch.{role}: {pool['count']} instances of tp={pool['tp']} do not fit on nodes "
                f"{names} (placed {placed}; {have} GPUs left there)"
            )
    check_ports(cfg, plans)
    return plans


def check_ports(cfg: dict[str, Any], plans: list[WorkerPlan]) -> None:
    """Refuse two listeners on one port of one node (a clash SGLang would only report at start-up)."""
    used: dict[tuple[str, int], str] = {}
    for p in plans:
        for key in ("port", "bootstrap_port", "kv_events_port", "kv_replay_port"):
            if key in p:
                k = (p["node"], p[key])
                if k in used:
                    raise LaunchConfigError(
                        f"port {p[key]} on node {p['node']} used by {used[k]} and {p['name']}.{key}"
                    )
                used[k] = f"{p['name']}.{key}"
