"""Reading the ``launch`` section of a real-SGLang deployment: the helpers every renderer shares.

The per-node launcher (``stack.launch.sglang``) and the Kubernetes renderer (``stack.launch.k8s``)
read the same config the same way: which engine, each pool with its defaults filled in, the
nodes. Keeping these readers public in their own module lets both renderers import them
without reaching into each other's private names (and without an import cycle between them).

Pure data; nothing heavier than PyYAML (imported lazily) is needed.
"""

from __future__ import annotations

import copy
import ipaddress
from pathlib import Path
from typing import Any

from stack.launch.spec import LaunchConfigError

__all__ = [
    "LaunchConfigError",
    "POOL_DEFAULTS",
    "as_dict",
    "sglang_launch",
    "section",
    "pool_settings",
    "is_loopback",
    "node_list",
    "load_yaml",
]

#: keys that mean the same for both pools
_COMMON_POOL_DEFAULTS: dict[str, Any] = {
    "count": 1,
    "tp": 1,
    "kv_events_topic": "kv",
    "transfer_backend": "mooncake",
    "chunked_prefill_size": None,
    "mem_fraction_static": None,
    "max_total_tokens": None,
    "metrics": True,
    "hicache": {"enabled": False},
    "extra_args": [],
    "env": {},
}

#: per pool: its own ports on top of the common keys (decode has no bootstrap server, and
#: publishes no KV events unless asked)
POOL_DEFAULTS: dict[str, dict[str, Any]] = {
    "prefill": {**_COMMON_POOL_DEFAULTS, "port": 30000, "bootstrap_port": 8998, "kv_events_port": 5557},
    "decode": {**_COMMON_POOL_DEFAULTS, "port": 31000, "kv_events_port": None},
}


def as_dict(config: Any) -> dict[str, Any]:
    """Accept a plain dict or a pydantic ``DeploymentConfig``."""
    if isinstance(config, dict):
        return config
    dump = getattr(config, "model_dump", None)
    if dump is not None:
        return dump(exclude_none=False)
    raise TypeError(f"config must be a mapping, not {type(config).__name__}")


def sglang_launch(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``launch`` section, refused unless it describes real SGLang workers."""
    launch = cfg.get("launch") or {}
    if not isinstance(launch, dict):
        raise LaunchConfigError("launch: must be a mapping")
    engine = launch.get("engine", "sglang")
    if engine != "sglang":
        raise LaunchConfigError(f"launch.engine is {engine!r}; this launcher builds engine: sglang")
    return launch


def section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """A top-level section as a mapping ({} when absent or not a mapping)."""
    v = cfg.get(name) or {}
    return v if isinstance(v, dict) else {}


def pool_settings(launch: dict[str, Any], role: str) -> dict[str, Any]:
    """``launch.prefill`` / ``launch.decode`` over :data:`POOL_DEFAULTS`, validated.

    A ``hicache`` mapping turns the tier on unless it says ``enabled: false``.
    """
    raw = launch.get(role)
    if raw is None:
        raise LaunchConfigError(f"launch.{role}: missing (give at least its count)")
    if not isinstance(raw, dict):
        raise LaunchConfigError(f"launch.{role}: must be a mapping")
    pool = copy.deepcopy(POOL_DEFAULTS[role])
    for k, v in raw.items():
        if k == "hicache" and isinstance(v, dict):
            pool["hicache"] = {"enabled": True, **v}
        else:
            pool[k] = v
    for k in ("count", "tp"):
        if not isinstance(pool[k], int) or pool[k] < (0 if k == "count" else 1):
            raise LaunchConfigError(f"launch.{role}.{k}: must be an integer >= {0 if k == 'count' else 1}")
    if not isinstance(pool["extra_args"], list):
        raise LaunchConfigError(f"launch.{role}.extra_args: must be a list of strings")
    return pool


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (binds stay private, Redis keeps protected mode)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_list(launch: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """``launch.nodes`` with ``host``, ``gpu_ids`` and ``ib_devices`` filled in.

    No nodes: one loopback node (8 GPUs, none on ``device: cpu``).
    """
    raw = launch.get("nodes")
    if not raw:
        raw = [{"name": "local", "host": "127.0.0.1", "gpus": 0 if device == "cpu" else 8}]
    out = []
    seen = set()
    for i, n in enumerate(raw):
        if not isinstance(n, dict) or "name" not in n:
            raise LaunchConfigError(f"launch.nodes[{i}]: needs at least a name")
        name = str(n["name"])
        if name in seen:
            raise LaunchConfigError(f"launch.nodes: duplicate node name {name!r}")
        seen.add(name)
        gpus = n.get("gpus", 8)
        gpu_ids = list(range(gpus)) if isinstance(gpus, int) else [int(g) for g in gpus]
        ib = n.get("ib_devices") or []
        if isinstance(ib, str):
            ib = [s for s in ib.split(",") if s]
        out.append(
            {**n, "name": name, "host": str(n.get("host", name)), "gpu_ids": gpu_ids, "ib_devices": ib}
        )
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a deployment YAML as a plain dict (no validation beyond YAML itself)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{path}: top level must be a mapping")
    return data
