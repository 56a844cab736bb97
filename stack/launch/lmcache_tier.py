"""``launch.kv_tier: lmcache``: the LMCache server per node, its controller, and what SGLang needs.

A deployment picks one KV tier below the GPU: ``hicache`` (today's default: SGLang's HiCache
with the Mooncake store behind it) or ``lmcache`` (SGLang's ``--enable-lmcache``, each node a
standalone ``lmcache server`` daemon with the Mooncake store as its L2, and an
``lmcache_controller`` the router asks which prefixes LMCache holds). SGLang refuses the two
together; this module refuses them first, with the config key to change.

What SGLang 0.5.23 accepts (checked by tests/integration/test_sglang_args.py with SGLang's own resolution
pipeline, not only its argparse table): ``--enable-lmcache`` refuses
``--enable-hierarchical-cache`` ("mutually exclusive") and any ``--disaggregation-mode``
("LMCacheUnifiedRadixCache currently supports colocated prefill/decode scheduling only"). So
with ``kv_tier: lmcache`` every pool that runs must say ``disaggregation: false`` (colocated
workers); a PD pool is a config error here rather than a worker that dies at start-up.

``launch`` keys::

    kv_tier: lmcache                # hicache (default) | lmcache
    lmcache:
      command: lmcache              # LMCache's CLI (in LMCache's own environment, e.g.
                                    # /opt/lmcache-venv/bin/lmcache); `lmcache server ...`
      controller_command: lmcache_controller
      chunk_size: 256
      server: {port: 5556, http_port: 8088, l1_size_gb: 20, eviction_policy: LRU,
               l2: mooncake,        # mooncake | none: the Mooncake store as LMCache's L2
               extra_args: []}
      controller: {node: n0, port: 9000, pull_port: 8300, reply_port: 8400}   # null: none
      env: {}

Pure data, like the rest of the launcher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stack.launch.sglang_config import LaunchConfigError, is_loopback, pool_settings
from stack.launch.spec import ProcessSpec

__all__ = [
    "KV_TIERS",
    "LMCACHE_DEFAULTS",
    "kv_tier",
    "lmcache_settings",
    "check_pools",
    "config_file_path",
    "config_file_text",
    "worker_args",
    "server_specs",
    "controller_argv",
    "controller_spec",
    "controller_url",
]

KV_TIERS = ("hicache", "lmcache")

LMCACHE_DEFAULTS: dict[str, Any] = {
    "command": "lmcache",
    "controller_command": "lmcache_controller",
    "chunk_size": 256,
    "server": {
        "port": 5556,
        "http_port": 8088,
        "l1_size_gb": 20,
        "eviction_policy": "LRU",
        "l2": "mooncake",
        "extra_args": [],
    },
    "controller": {"port": 9000, "pull_port": 8300, "reply_port": 8400},
    "env": {},
}

#: every LMCache process: the same hash seed everywhere (LMCache's token database hashes chunks
#: with Python's hash() unless told otherwise; the controller and every engine must agree)
LMCACHE_ENV = {"PYTHONHASHSEED": "0", "LMCACHE_DISABLE_BANNER": "1"}


def kv_tier(launch: dict[str, Any]) -> str:
    """``launch.kv_tier`` (default ``hicache``), validated."""
    t = launch.get("kv_tier", "hicache")
    if t not in KV_TIERS:
        raise LaunchConfigError(f"launch.kv_tier: {t!r}; give one of {', '.join(KV_TIERS)}")
    return str(t)


def lmcache_settings(launch: dict[str, Any]) -> dict[str, Any]:
    """``launch.lmcache`` over :data:`LMCACHE_DEFAULTS` (``controller: null`` keeps none)."""
    raw = launch.get("lmcache") or {}
    if not isinstance(raw, dict):
        raise LaunchConfigError("launch.lmcache: must be a mapping")
    out = json.loads(json.dumps(LMCACHE_DEFAULTS))
    for k, v in raw.items():
        if k in ("server", "controller") and isinstance(v, dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    cs = out["chunk_size"]
    if not isinstance(cs, int) or cs < 1:
        raise LaunchConfigError(f"launch.lmcache.chunk_size: must be a positive integer (got {cs!r})")
    if out["server"].get("l2") not in ("mooncake", "none", None):
        raise LaunchConfigError(
            f"launch.lmcache.server.l2: {out['server'].get('l2')!r}; give mooncake or none"
        )
    if not isinstance(out["server"].get("extra_args") or [], list):
        raise LaunchConfigError("launch.lmcache.server.extra_args: must be a list of strings")
    return out


def check_pools(launch: dict[str, Any]) -> None:
    """Refuse what SGLang 0.5.23 refuses with ``--enable-lmcache``: HiCache on a pool, or a
    pool in PD disaggregation mode."""
    for role in ("prefill", "decode"):
        if launch.get(role) is None:
            continue
        pool = pool_settings(launch, role)
        if not pool["count"]:
            continue
        if (pool.get("hicache") or {}).get("enabled"):
            raise LaunchConfigError(
                f"launch.{role}.hicache: kv_tier lmcache and HiCache are one tier or the other "
                "(SGLang: --enable-lmcache and --enable-hierarchical-cache are mutually exclusive); "
                f"remove launch.{role}.hicache or set launch.kv_tier: hicache"
            )
        if pool.get("disaggregation", True):
            raise LaunchConfigError(
                f"launch.{role}: kv_tier lmcache needs colocated workers (disaggregation: false): "
                "SGLang 0.5.23 refuses --enable-lmcache with --disaggregation-mode "
                "(LMCacheUnifiedRadixCache supports colocated prefill/decode only); "
                "use launch.kv_tier: hicache for a PD deployment"
            )


def config_file_path(launch: dict[str, Any], node: str) -> str:
    """The YAML a worker on ``node`` names with ``--lmcache-config-file``."""
    return str(Path(launch.get("run_dir", ".smetric/run")) / f"lmcache-{node}.yaml")


def config_file_text(launch: dict[str, Any], host: str) -> str:
    """SGLang's LMCache config (MP mode): the node's LMCache server."""
    s = lmcache_settings(launch)
    return f"# SGLang -> the LMCache server on this node (lmcache server)\nmp_host: {host}\nmp_port: {int(s['server']['port'])}\n"


def worker_args(launch: dict[str, Any], node: str) -> list[str]:
    """The flags of ``kv_tier: lmcache`` on a worker placed on ``node``."""
    return ["--enable-lmcache", "--lmcache-config-file", config_file_path(launch, node)]


def _l2_adapter(launch: dict[str, Any], host: str, master: str | None, device: str) -> str | None:
    s = lmcache_settings(launch)
    if s["server"].get("l2") in ("none", None):
        return None
    if not master:
        raise LaunchConfigError(
            "launch.lmcache.server.l2: mooncake needs mooncake.master or launch.mooncake_master "
            "(or set launch.lmcache.server.l2: none)"
        )
    st = {
        "protocol": "tcp" if device == "cpu" else "rdma",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "4gb",
        **(launch.get("mooncake_store") or {}),
    }
    seg = str(st["global_segment_size"]).strip().lower()
    if not (seg.isdigit() or (seg.endswith("gb") and seg[:-2].isdigit())):
        raise LaunchConfigError(
            f"launch.mooncake_store.global_segment_size: {st['global_segment_size']!r}: give bytes or '<n>gb'"
        )
    seg_bytes = int(seg[:-2]) << 30 if seg.endswith("gb") else int(seg)
    spec = {
        "type": "mooncake_store",
        "local_hostname": host,
        "metadata_server": str(st["metadata_server"]),
        "protocol": str(st["protocol"]),
        # forwarded as is to Mooncake's setup(ConfigDict), whose key (0.3.13) is this one
        "master_server_addr": master,
        "global_segment_size": str(seg_bytes),
        "local_buffer_size": "0",
    }
    if st.get("device"):
        spec["device_name"] = str(st["device"])
    return json.dumps(spec, separators=(",", ":"))


def server_specs(
    launch: dict[str, Any],
    nodes: dict[str, dict[str, Any]],
    used_nodes: list[str],
    bind: str,
    master: str | None,
    common_env: dict[str, str],
) -> list[ProcessSpec]:
    """One ``lmcache server`` per node that runs an LMCache worker (``used_nodes``, in order)."""
    s = lmcache_settings(launch)
    srv = s["server"]
    device = launch.get("device", "cuda")
    env = {**common_env, **LMCACHE_ENV, **{k: str(v) for k, v in (s.get("env") or {}).items()}}
    out = []
    for name in used_nodes:
        host = nodes[name]["host"]
        listen = host if is_loopback(host) else bind
        argv = [
            str(s["command"]),
            "server",
            "--host",
            listen,
            "--port",
            str(int(srv["port"])),
            "--chunk-size",
            str(int(s["chunk_size"])),
            "--l1-size-gb",
            str(srv["l1_size_gb"]),
            "--eviction-policy",
            str(srv["eviction_policy"]),
            "--http-host",
            listen,
            "--http-port",
            str(int(srv["http_port"])),
        ]
        l2 = _l2_adapter(launch, host, master, device)
        if l2:
            argv += ["--l2-adapter", l2]
        argv += [str(x) for x in srv.get("extra_args") or []]
        out.append(
            ProcessSpec(
                name=f"lmcache-server-{name}" if len(used_nodes) > 1 else "lmcache-server",
                role="lmcache_server",
                argv=argv,
                env=dict(env),
                host=host,
                node=name,
                ready_url=f"http://{host}:{int(srv['http_port'])}/healthcheck",
                ready_port=int(srv["port"]),
            )
        )
    return out


def _controller(launch: dict[str, Any], nodes: dict[str, dict[str, Any]], default_node: str) -> dict | None:
    s = lmcache_settings(launch)
    raw = (launch.get("lmcache") or {}).get("controller", {})
    if raw is None or raw is False:
        return None
    c = dict(s["controller"])
    node = c.get("node") or default_node
    if node not in nodes:
        raise LaunchConfigError(f"launch.lmcache.controller.node: unknown node {node!r}")
    return {**c, "node": node, "host": nodes[node]["host"]}


def controller_url(launch: dict[str, Any], nodes: dict[str, dict[str, Any]], default_node: str) -> str | None:
    """The controller's HTTP address (what the router's LMCache view asks), or None."""
    c = _controller(launch, nodes, default_node)
    return f"http://{c['host']}:{int(c['port'])}" if c else None


def controller_argv(command: str, host: str, port: int, pull_port: int, reply_port: int) -> list[str]:
    """``lmcache_controller``: HTTP API on ``host:port``, the engines' reports on the pull and
    reply ports (what their ``controller_pull_url`` / ``controller_reply_url`` name)."""
    monitor = json.dumps({"pull": int(pull_port), "reply": int(reply_port)}, separators=(",", ":"))
    return [command, "--host", host, "--port", str(int(port)), "--monitor-ports", monitor]


def controller_spec(
    launch: dict[str, Any],
    nodes: dict[str, dict[str, Any]],
    default_node: str,
    bind: str,
    common_env: dict[str, str],
) -> ProcessSpec | None:
    """``lmcache_controller`` on ``launch.lmcache.controller.node`` (default: the router's)."""
    c = _controller(launch, nodes, default_node)
    if c is None:
        return None
    s = lmcache_settings(launch)
    listen = c["host"] if is_loopback(c["host"]) else bind
    argv = controller_argv(str(s["controller_command"]), listen, c["port"], c["pull_port"], c["reply_port"])
    argv += [str(x) for x in c.get("extra_args") or []]
    env = {**common_env, **LMCACHE_ENV, **{k: str(v) for k, v in (s.get("env") or {}).items()}}
    return ProcessSpec(
        name="lmcache-controller",
        role="lmcache_controller",
        argv=argv,
        env=env,
        host=c["host"],
        node=c["node"],
        ready_port=int(c["port"]),
    )
