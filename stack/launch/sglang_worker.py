"""The command line and environment of one SGLang worker (``sglang.launch_server``).

Split from the process list (``stack.launch.sglang``) because this is the part that must match
SGLang itself: tests/integration/test_sglang_args.py feeds every argument list built here to SGLang's own
parser, and the CPU tier (tests/sglang_cpu) runs them. Pure data.
"""

from __future__ import annotations

import json
from typing import Any

from stack.launch.lmcache_tier import kv_tier
from stack.launch.lmcache_tier import worker_args as lmcache_worker_args
from stack.launch.sglang_config import LaunchConfigError, section
from stack.launch.sglang_placement import WorkerPlan
from stack.launch.spec import ENV_NAME

__all__ = [
    "CPU_ENV",
    "CPU_PREFILL_ENV",
    "CPU_MAX_TOTAL_TOKENS",
    "PRIORITY_POLICIES",
    "ib_for",
    "priority_args",
    "priority_scheduling",
    "worker_argv",
    "worker_env",
    "worker_key_args",
    "worker_key_envs",
]

#: what every CPU worker was found to need (tests/sglang_cpu runs with these)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
CPU_PREFILL_ENV = {
    # each avoids a CUDA-only step on the prefill side of a PD pair
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}
CPU_MAX_TOTAL_TOKENS = 16384


def ib_for(node: dict[str, Any], gpus: list[int]) -> str | None:
    """``--disaggregation-ib-device`` for an instance: the NIC of each of its GPUs.

    One GPU: that GPU's NIC. Several: a JSON map keyed by the process-visible GPU id (after
    CUDA_VISIBLE_DEVICES, so 0..tp-1), as SGLang documents it.
    """
    ib = node["ib_devices"]
    if not ib:
        return None
    if not gpus:
        return ib[0]
    pos = {g: i for i, g in enumerate(node["gpu_ids"])}
    nics = [ib[pos.get(g, 0) % len(ib)] for g in gpus]
    if len(nics) == 1:
        return nics[0]
    return json.dumps({str(i): nic for i, nic in enumerate(nics)}, separators=(",", ":"))


def flag(argv: list[str], name: str, value: Any) -> None:
    """Append ``name value`` (``name`` alone for True; nothing for None/False).

    Unset settings leave SGLang's own default in force instead of restating it here.
    """
    if value is None or value is False:
        return
    if value is True:
        argv.append(name)
    else:
        argv.extend([name, str(value)])


def worker_argv(
    cfg: dict[str, Any],
    launch: dict[str, Any],
    plan: WorkerPlan,
    pool: dict[str, Any],
    bind: str,
    ib: str | None,
) -> list[str]:
    model = section(cfg, "model")
    device = launch.get("device", "cuda")
    model_path = launch.get("model_path") or model.get("path")
    if not model_path:
        raise LaunchConfigError("launch.model_path (or model.path): the model directory on every node")
    a: list[str] = [str(launch.get("python", "python3")), "-m", "sglang.launch_server"]
    flag(a, "--model-path", model_path)
    flag(a, "--served-model-name", launch.get("served_model_name") or model.get("name"))
    flag(a, "--host", bind)
    flag(a, "--port", plan["port"])
    flag(a, "--tp-size", pool["tp"])
    flag(a, "--page-size", pool.get("page_size") or model.get("page_size") or 64)
    flag(a, "--context-length", pool.get("context_length") or model.get("context_length"))
    flag(a, "--mem-fraction-static", pool.get("mem_fraction_static"))
    flag(a, "--chunked-prefill-size", pool.get("chunked_prefill_size"))
    mtt = pool.get("max_total_tokens")
    if device == "cpu":
        flag(a, "--device", "cpu")
        flag(a, "--disable-cuda-graph", True)
        mtt = mtt or CPU_MAX_TOTAL_TOKENS
    flag(a, "--max-total-tokens", mtt)
    flag(a, "--enable-metrics", bool(pool.get("metrics")))
    flag(a, "--tool-call-parser", model.get("tool_call_parser"))
    flag(a, "--reasoning-parser", model.get("reasoning_parser"))
    if "kv_events_port" in plan:
        kv = {
            "publisher": "zmq",
            "endpoint": f"tcp://*:{plan['kv_events_port']}",
            "topic": pool["kv_events_topic"],
        }
        if "kv_replay_port" in plan:  # the last 10,000 batches, for a router that missed some
            kv["replay_endpoint"] = f"tcp://*:{plan['kv_replay_port']}"
        flag(a, "--kv-events-config", json.dumps(kv, separators=(",", ":")))
    if plan["role"] in ("prefill", "decode") and pool.get("disaggregation", True):
        flag(a, "--disaggregation-mode", plan["role"])
        flag(a, "--disaggregation-transfer-backend", pool["transfer_backend"])
        if plan["role"] == "prefill":
            flag(a, "--disaggregation-bootstrap-port", plan["bootstrap_port"])
        if pool["transfer_backend"] in ("mooncake", "nixl"):
            flag(a, "--disaggregation-ib-device", ib)
        if plan["role"] == "decode" and device == "cpu":
            flag(a, "--disaggregation-decode-retraction-backup", "cpu_tensor")
    hc = pool.get("hicache") or {}
    if hc.get("enabled"):
        flag(a, "--enable-hierarchical-cache", True)
        flag(a, "--hicache-ratio", hc.get("ratio"))
        flag(a, "--hicache-size", hc.get("size_gb"))
        flag(a, "--hicache-write-policy", hc.get("write_policy"))
        flag(a, "--hicache-mem-layout", hc.get("mem_layout"))
        flag(a, "--hicache-io-backend", hc.get("io_backend") or ("direct" if device == "cpu" else None))
        flag(a, "--hicache-storage-backend", hc.get("storage_backend"))
        flag(a, "--hicache-storage-prefetch-policy", hc.get("prefetch_policy"))
    if kv_tier(launch) == "lmcache":
        a.extend(lmcache_worker_args(launch, plan["node"]))
    extra = [str(x) for x in (launch.get("extra_args") or [])] + [str(x) for x in pool["extra_args"]]
    if priority_scheduling(launch):
        a.extend(priority_args(extra, plan["role"]))
    a.extend(worker_key_args(launch))
    a.extend(extra)
    return a


#: launch.sglang field -> SGLang's flag: the env var that holds the workers' key
_KEY_FLAGS = (("api_key_env", "--api-key"), ("admin_api_key_env", "--admin-api-key"))


def worker_key_envs(launch: dict[str, Any]) -> dict[str, str]:
    """``launch.sglang.api_key_env`` / ``admin_api_key_env`` (the env vars holding the
    workers' ``--api-key`` / ``--admin-api-key``), validated: {field: env var name}."""
    sg = launch.get("sglang") or {}
    if not isinstance(sg, dict):
        raise LaunchConfigError("launch.sglang: must be a mapping")
    out = {}
    for field, _ in _KEY_FLAGS:
        v = sg.get(field)
        if v is None:
            continue
        if not isinstance(v, str) or not ENV_NAME.match(v):
            raise LaunchConfigError(
                f"launch.sglang.{field}: must be an environment variable name (got {v!r})"
            )
        out[field] = v
    return out


def worker_key_args(launch: dict[str, Any]) -> list[str]:
    """``--api-key $(NAME)`` / ``--admin-api-key $(NAME)`` of ``launch.sglang``'s key env vars:
    the key itself never enters a spec, a dry run or a manifest; the launcher substitutes it
    when it starts the worker (``stack.launch.spec.expand_secrets``), Kubernetes from a
    Secret. The router gets the same names (``router.auth.worker_api_key_env`` / ``...admin...``)
    and sends the keys: every call with the API key, ``/abort_request`` with the admin key
    (SGLang 0.5.23 accepts only it there once it is set)."""
    envs = worker_key_envs(launch)
    out: list[str] = []
    for field, flag in _KEY_FLAGS:
        if field in envs:
            out += [flag, f"$({envs[field]})"]
    return out


#: the schedule policies SGLang 0.5.23 allows with --enable-priority-scheduling
#: (arg_groups/validation_hook.py)
PRIORITY_POLICIES = ("fcfs", "lof")


def priority_scheduling(launch: dict[str, Any]) -> bool:
    """``launch.sglang.priority_scheduling`` (default false), validated."""
    sg = launch.get("sglang") or {}
    if not isinstance(sg, dict):
        raise LaunchConfigError("launch.sglang: must be a mapping")
    v = sg.get("priority_scheduling", False)
    if not isinstance(v, bool):
        raise LaunchConfigError(f"launch.sglang.priority_scheduling: must be true or false (got {v!r})")
    return v


def _flag_value(args: list[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``name v`` or ``name=v``; the last one wins)."""
    out = None
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            out = args[i + 1]
        elif x.startswith(name + "="):
            out = x[len(name) + 1 :]
    return out


def priority_args(extra: list[str], role: str) -> list[str]:
    """The flags of ``launch.sglang.priority_scheduling`` on a worker of ``role`` (both
    pools: the decode side sorts its pre-allocation and waiting queues by priority too).

    The router sends HIGHER values for earlier deadlines (``router.dispatch.sglang_priority``),
    SGLang's default direction, so ``--schedule-low-priority-values-first`` is refused.
    Preemption is disabled (``--disable-priority-preemption``): the router's priorities are
    coarse classes (:mod:`stack.dispatch.sglang_priority`), and a preempted prefill in
    a PD pair wastes its work and its transfer.
    Priority scheduling needs ``--schedule-policy`` fcfs or lof: fcfs is set unless the
    config's extra_args name one of the two; any other is a config error.
    """
    where = f"launch.sglang.priority_scheduling ({role})"
    if "--schedule-low-priority-values-first" in extra:
        raise LaunchConfigError(
            f"{where}: extra_args has --schedule-low-priority-values-first; the router's "
            "priorities are higher-runs-first (SGLang's default), remove it"
        )
    policy = _flag_value(extra, "--schedule-policy")
    out = ["--enable-priority-scheduling", "--disable-priority-preemption"]
    if policy is None:
        out += ["--schedule-policy", "fcfs"]
    elif policy not in PRIORITY_POLICIES:
        raise LaunchConfigError(
            f"{where}: extra_args sets --schedule-policy {policy}; SGLang's priority scheduling "
            f"needs one of {', '.join(PRIORITY_POLICIES)}"
        )
    return out


def worker_env(
    cfg: dict[str, Any],
    launch: dict[str, Any],
    plan: WorkerPlan,
    pool: dict[str, Any],
    master: str | None,
    ib: str | None,
) -> dict[str, str]:
    device = launch.get("device", "cuda")
    env: dict[str, str] = {}
    if device == "cpu":
        env.update(CPU_ENV)
        if plan["role"] == "prefill":
            env.update(CPU_PREFILL_ENV)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in plan["gpus"])
        env["HF_HUB_OFFLINE"] = "1"
    # the address the PD bootstrap server advertises, and Mooncake's own name for this host
    env["SGLANG_HOST_IP"] = plan["host"]
    hc = pool.get("hicache") or {}
    if hc.get("enabled") and hc.get("storage_backend") == "mooncake":
        if not master:
            raise LaunchConfigError(
                "hicache storage_backend mooncake needs mooncake.master or launch.mooncake_master"
            )
        st = {
            "protocol": "tcp" if device == "cpu" else "rdma",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": "4gb",
            "local_buffer_size": None,
            "device_from_ib": True,
            **(launch.get("mooncake_store") or {}),
        }
        seg = str(st["global_segment_size"]).strip().lower()
        if not (seg.isdigit() or (seg.endswith("gb") and seg[:-2].isdigit())):
            # SGLang 0.5.23 parses only bytes or "<n>gb" (e.g. "256mb" fails at start-up)
            raise LaunchConfigError(
                f"launch.mooncake_store.global_segment_size: {st['global_segment_size']!r}: give bytes or '<n>gb'"
            )
        env["MOONCAKE_MASTER"] = master
        env["MOONCAKE_PROTOCOL"] = str(st["protocol"])
        env["MOONCAKE_TE_META_DATA_SERVER"] = str(st["metadata_server"])
        env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = str(st["global_segment_size"])
        env["MOONCAKE_LOCAL_HOSTNAME"] = plan["host"]
        if st.get("local_buffer_size"):
            env["MOONCAKE_LOCAL_BUFFER_SIZE"] = str(st["local_buffer_size"])
        if st["protocol"] == "rdma" and st.get("device_from_ib") and ib:
            # the store wants a plain comma list of NICs (not the per-GPU JSON map)
            nics = list(json.loads(ib).values()) if ib.startswith("{") else [ib]
            env["MOONCAKE_DEVICE"] = ",".join(dict.fromkeys(nics))
        elif st.get("device"):
            env["MOONCAKE_DEVICE"] = str(st["device"])
    if priority_scheduling(launch):
        # /v1/messages has no priority field: the router sends x-override-priority instead
        env["SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"] = "1"
    env.update({k: str(v) for k, v in (launch.get("env") or {}).items()})
    env.update({k: str(v) for k, v in (pool.get("env") or {}).items()})
    return env
