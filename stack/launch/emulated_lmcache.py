"""``launch.kv_tier: lmcache`` on the emulated local stack (``configs/local-lmcache.yaml``).

Each emulated prefill worker gets a real LMCache engine beside it
(:mod:`stack.kv_tier.lmcache_engine_sidecar`, in LMCache's own environment; role
``lmcache_server``, the per-worker counterpart of a node's ``lmcache server``) with the
Mooncake store behind it, and the stack one real ``lmcache_controller`` (role
``lmcache_controller``); the worker's global tier goes through its engine
(``--lmcache-url``), and the router's global-tier view asks the controller
(``router.global_tier: lmcache``).

``launch.lmcache`` keys here: ``python`` (LMCache's interpreter; default
``$SMETRIC_LMCACHE_PYTHON`` or /opt/lmcache-venv/bin/python), ``controller_command`` (default:
``lmcache_controller`` beside that interpreter), ``controller: {port, pull_port, reply_port}``,
``engine: {port, worker_port, mooncake_port, port_stride}`` (instance i: + i * stride),
``chunk_size`` (256). Pure data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stack.kv_tier.lmcache_client import SIDECAR_ENV, lmcache_python, sidecar_argv
from stack.launch.lmcache_tier import controller_argv
from stack.launch.spec import ProcessSpec

__all__ = ["enabled", "plan", "ports", "specs", "worker_args", "router_settings"]

DEFAULTS = {
    "controller": {"port": 9000, "pull_port": 8300, "reply_port": 8400},
    "engine": {"port": 30005, "worker_port": 30006, "mooncake_port": 30007, "port_stride": 10},
}
ROOT = Path(__file__).resolve().parents[2]


def enabled(launch: dict[str, Any]) -> bool:
    t = launch.get("kv_tier", "hicache")
    if t not in ("hicache", "lmcache"):
        raise ValueError(f"launch.kv_tier: {t!r}; give hicache or lmcache")
    return t == "lmcache"


def plan(launch: dict[str, Any], prefill: list[dict[str, Any]], master: dict | None, port: Callable) -> dict:
    """Ports of the controller and of each prefill worker's engine (``port`` resolves auto)."""
    if master is None:
        raise ValueError("launch.kv_tier: lmcache needs launch.mooncake_master (LMCache's remote tier)")
    raw = launch.get("lmcache") or {}
    c = {**DEFAULTS["controller"], **(raw.get("controller") or {})}
    e = {**DEFAULTS["engine"], **(raw.get("engine") or {})}
    stride = int(e["port_stride"])
    py = raw.get("python") or lmcache_python() or "/opt/lmcache-venv/bin/python"
    return {
        "python": str(py),
        "controller_command": str(raw.get("controller_command") or Path(py).parent / "lmcache_controller"),
        "chunk_size": int(raw.get("chunk_size", 256)),
        "controller": {k: port(int(c[k])) for k in ("port", "pull_port", "reply_port")},
        "engines": [
            {k: port(int(e[k]) + it["index"] * stride) for k in ("port", "worker_port", "mooncake_port")}
            for it in prefill
        ],
    }


def ports(lp: dict[str, Any]) -> list[tuple[str, int]]:
    out = [(f"lmcache_controller.{k}", v) for k, v in lp["controller"].items()]
    for i, e in enumerate(lp["engines"]):
        out += [(f"lmcache-engine-{i}.{k}", v) for k, v in e.items()]
    return out


def specs(lp: dict[str, Any], host: str, master_rpc: int, env: dict[str, str]) -> list[ProcessSpec]:
    """The controller, then one LMCache engine per prefill worker."""
    c = lp["controller"]
    lm_env = {**env, **SIDECAR_ENV}
    out = [
        ProcessSpec(
            name="lmcache-controller",
            role="lmcache_controller",
            argv=controller_argv(lp["controller_command"], host, c["port"], c["pull_port"], c["reply_port"]),
            env=dict(lm_env),
            host=host,
            ready_port=c["port"],
        )
    ]
    for i, e in enumerate(lp["engines"]):
        argv = sidecar_argv(
            lp["python"],
            f"prefill-{i}",
            e["port"],
            controller=(f"{host}:{c['pull_port']}", f"{host}:{c['reply_port']}"),
            worker_port=e["worker_port"],
            mooncake_master=f"{host}:{master_rpc}",
            mooncake_port=e["mooncake_port"],
            chunk_size=lp["chunk_size"],
            host=host,
        )
        out.append(
            ProcessSpec(
                name=f"lmcache-engine-{i}",
                role="lmcache_server",
                argv=argv,
                # the sidecar module lives in this checkout; LMCache's interpreter imports it
                env={**lm_env, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"},
                host=host,
                ready_url=f"http://{host}:{e['port']}/health",
                ready_port=e["port"],
            )
        )
    return out


def worker_args(lp: dict[str, Any], host: str, index: int) -> list[str]:
    return ["--lmcache-url", f"http://{host}:{lp['engines'][index]['port']}"]


def router_settings(lp: dict[str, Any], host: str) -> dict[str, Any]:
    return {
        "global_tier": "lmcache",
        "lmcache_controller_url": f"http://{host}:{lp['controller']['port']}",
        "lmcache_chunk_size": lp["chunk_size"],
    }
