"""Real SGLang pools from one deployment YAML: process specs, per-node dry run, router config.

The launcher calls this module when a config says ``launch.engine: sglang``. Everything here is
pure data (no process is started, nothing heavier than PyYAML is imported), so the dry run, the
Kubernetes renderer (``stack.launch.k8s``) and the tests that feed every generated argument list
to SGLang's own parser all see exactly the commands an operator would run.

The config is the shared deployment YAML (``stack.config``): ``model``, ``router``, ``mooncake``
as usual; the ``prefill`` / ``decode`` worker lists are *derived* here from the pools described
under ``launch`` (see :func:`resolved_config`) and handed to the router in its own config file.

``launch`` keys (all optional except ``nodes`` and the pool counts; see docs/deploy.md)::

    launch:
      engine: sglang
      python: python3              # interpreter with sglang installed, on every node
      device: cuda                 # cuda | cpu (cpu: the CPU tier's flags and environment)
      model_path: /models/X        # default: model.path
      served_model_name: X         # default: model.name
      run_dir: /var/run/smetric    # where the router's resolved config is written
      bind_host: 0.0.0.0           # default: 0.0.0.0, or 127.0.0.1 when every node is loopback
      env: {K: V}                  # every process
      nodes:
        - {name: n0, host: 10.0.0.1, gpus: 8, ib_devices: [mlx5_0, ..., mlx5_7]}
      prefill:
        count: 32                  # instances
        tp: 1
        nodes: [n0, n1]            # placement order (default: every node)
        port: 30000                # HTTP port of the first instance on a node (+ port_stride each)
        bootstrap_port: 8998       # idem
        kv_events_port: 5557       # idem; null disables KV events
        transfer_backend: mooncake # mooncake | mooncake_tcp | nixl
        page_size: 64              # default: model.page_size
        chunked_prefill_size: 16384
        mem_fraction_static: 0.88
        context_length: 262144     # default: model.context_length
        max_total_tokens: null
        metrics: true
        hicache: {enabled: true, ratio: 2, storage_backend: mooncake, write_policy: write_through}
        extra_args: []             # appended verbatim
        env: {}
      decode: {count: 4, tp: 2, nodes: [n4], port: 31000, ...}   # same keys, no bootstrap/kv events
      mooncake_master: {node: n0, rpc_port: 50051, http_metadata_port: 8080, metrics_port: 9003}
      mooncake_store: {protocol: rdma, metadata_server: P2PHANDSHAKE, global_segment_size: 64gb,
                       local_buffer_size: 1gb, device_from_ib: true}
      redis: {node: n0, port: 6379}          # omit or null: no Redis (but see replicas)
      router: {node: n0, replicas: 1, ports: [8000, ...]}
                                   # replicas N > 1: N routers on the router node, replica i on
                                   # router.port + i (or ports[i]) with --replica-id r{i}, all on
                                   # one Redis; `smetric up` adds launch.redis when neither it nor
                                   # router.redis_url is given (stack/launch/replicas.py)
"""

from __future__ import annotations

import copy
import ipaddress
import json
import shlex
from pathlib import Path
from typing import Any

from stack.launch import replicas
from stack.launch.spec import ProcessSpec

__all__ = [
    "LaunchConfigError",
    "sglang_process_specs",
    "dry_run_text",
    "resolved_config",
    "router_config_path",
    "sglang_argvs",
    "pools",
    "WorkerPlan",
    "load_yaml",
]

POOL_DEFAULTS: dict[str, dict[str, Any]] = {
    "prefill": {
        "count": 1,
        "tp": 1,
        "port": 30000,
        "bootstrap_port": 8998,
        "kv_events_port": 5557,
        "kv_events_topic": "kv",
        "transfer_backend": "mooncake",
        "chunked_prefill_size": None,
        "mem_fraction_static": None,
        "max_total_tokens": None,
        "metrics": True,
        "hicache": {"enabled": False},
        "extra_args": [],
        "env": {},
    },
    "decode": {
        "count": 1,
        "tp": 1,
        "port": 31000,
        "kv_events_port": None,
        "kv_events_topic": "kv",
        "transfer_backend": "mooncake",
        "chunked_prefill_size": None,
        "mem_fraction_static": None,
        "max_total_tokens": None,
        "metrics": True,
        "hicache": {"enabled": False},
        "extra_args": [],
        "env": {},
    },
}

#: what DESIGN §6 found every CPU worker needs (tests/sglang_cpu runs with these)
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
CPU_PREFILL_ENV = {
    # each avoids a CUDA-only step on the prefill side of a PD pair
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}
CPU_MAX_TOTAL_TOKENS = 16384


class LaunchConfigError(ValueError):
    """The ``launch`` section cannot be turned into processes (a readable one-line reason)."""


# --------------------------------------------------------------------------------------------
# config access


def _as_dict(config: Any) -> dict[str, Any]:
    """Accept a plain dict or a pydantic ``DeploymentConfig``."""
    if isinstance(config, dict):
        return config
    dump = getattr(config, "model_dump", None)
    if dump is not None:
        return dump(exclude_none=False)
    raise TypeError(f"config must be a mapping, not {type(config).__name__}")


def _launch(cfg: dict[str, Any]) -> dict[str, Any]:
    launch = cfg.get("launch") or {}
    if not isinstance(launch, dict):
        raise LaunchConfigError("launch: must be a mapping")
    engine = launch.get("engine", "sglang")
    if engine != "sglang":
        raise LaunchConfigError(f"launch.engine is {engine!r}; this launcher builds engine: sglang")
    return launch


def _section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    v = cfg.get(name) or {}
    return v if isinstance(v, dict) else {}


def _pool(launch: dict[str, Any], role: str) -> dict[str, Any]:
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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _nodes(launch: dict[str, Any], device: str) -> list[dict[str, Any]]:
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


# --------------------------------------------------------------------------------------------
# placement


class WorkerPlan(dict):
    """One SGLang instance: role, index, node, host, gpus, ports (a dict, for easy dumping)."""


def pools(config: Any) -> list[WorkerPlan]:
    """Place every prefill and decode instance on a node and its GPUs (prefill first).

    Instances of a pool fill its nodes in order, ``tp`` GPUs at a time from each node's free
    GPUs. On ``device: cpu`` GPUs are not counted (every instance fits anywhere; the pool's
    ``per_node`` cap, default 1 for CPU, spreads them).
    """
    cfg = _as_dict(config)
    launch = _launch(cfg)
    device = launch.get("device", "cuda")
    nodes = _nodes(launch, device)
    by_name = {n["name"]: n for n in nodes}
    free = {n["name"]: list(n["gpu_ids"]) for n in nodes}
    local_index: dict[tuple[str, str], int] = {}
    plans: list[WorkerPlan] = []
    for role in ("prefill", "decode"):
        pool = _pool(launch, role)
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
                plans.append(plan)
                placed += 1
                on_this += 1
        if placed < pool["count"]:
            have = sum(len(free[n]) for n in names)
            raise LaunchConfigError(
                f"launch.{role}: {pool['count']} instances of tp={pool['tp']} do not fit on nodes "
                f"{names} (placed {placed}; {have} GPUs left there)"
            )
    _check_ports(cfg, plans)
    return plans


def _check_ports(cfg: dict[str, Any], plans: list[WorkerPlan]) -> None:
    used: dict[tuple[str, int], str] = {}
    for p in plans:
        for key in ("port", "bootstrap_port", "kv_events_port"):
            if key in p:
                k = (p["node"], p[key])
                if k in used:
                    raise LaunchConfigError(
                        f"port {p[key]} on node {p['node']} used by {used[k]} and {p['name']}.{key}"
                    )
                used[k] = f"{p['name']}.{key}"


# --------------------------------------------------------------------------------------------
# helpers for addresses


def _master(cfg: dict[str, Any], launch: dict[str, Any], nodes: dict[str, dict]) -> dict[str, Any] | None:
    """mooncake_master placement; None when no process should be started for it."""
    m = launch.get("mooncake_master", {})
    if m is None or m is False:
        return None
    m = dict(m or {})
    needs = any(
        (_pool(launch, r).get("hicache") or {}).get("storage_backend") == "mooncake"
        for r in ("prefill", "decode")
        if launch.get(r) is not None
    )
    if not m and (not needs or _section(cfg, "mooncake").get("master")):
        return None  # nothing uses it, or an external master is given as mooncake.master
    node = m.get("node") or next(iter(nodes))
    if node not in nodes:
        raise LaunchConfigError(f"launch.mooncake_master.node: unknown node {node!r}")
    m.setdefault("rpc_port", 50051)
    m.setdefault("http_metadata_port", 8080)
    m.setdefault("metrics_port", 9003)
    m["node"] = node
    m["host"] = nodes[node]["host"]
    return m


def _master_address(cfg: dict[str, Any], launch: dict[str, Any], nodes: dict[str, dict]) -> str | None:
    mc = _section(cfg, "mooncake")
    if mc.get("master"):
        return str(mc["master"])
    m = _master(cfg, launch, nodes)
    return f"{m['host']}:{m['rpc_port']}" if m else None


def _bind_host(launch: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    if launch.get("bind_host"):
        return str(launch["bind_host"])
    return "127.0.0.1" if all(_is_loopback(n["host"]) for n in nodes) else "0.0.0.0"


def _ib_for(node: dict[str, Any], gpus: list[int]) -> str | None:
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


# --------------------------------------------------------------------------------------------
# argv


def _flag(argv: list[str], name: str, value: Any) -> None:
    if value is None or value is False:
        return
    if value is True:
        argv.append(name)
    else:
        argv.extend([name, str(value)])


def _worker_argv(
    cfg: dict[str, Any],
    launch: dict[str, Any],
    plan: WorkerPlan,
    pool: dict[str, Any],
    bind: str,
    ib: str | None,
) -> list[str]:
    model = _section(cfg, "model")
    device = launch.get("device", "cuda")
    model_path = launch.get("model_path") or model.get("path")
    if not model_path:
        raise LaunchConfigError("launch.model_path (or model.path): the model directory on every node")
    a: list[str] = [str(launch.get("python", "python3")), "-m", "sglang.launch_server"]
    _flag(a, "--model-path", model_path)
    _flag(a, "--served-model-name", launch.get("served_model_name") or model.get("name"))
    _flag(a, "--host", bind)
    _flag(a, "--port", plan["port"])
    _flag(a, "--tp-size", pool["tp"])
    _flag(a, "--page-size", pool.get("page_size") or model.get("page_size") or 64)
    _flag(a, "--context-length", pool.get("context_length") or model.get("context_length"))
    _flag(a, "--mem-fraction-static", pool.get("mem_fraction_static"))
    _flag(a, "--chunked-prefill-size", pool.get("chunked_prefill_size"))
    mtt = pool.get("max_total_tokens")
    if device == "cpu":
        _flag(a, "--device", "cpu")
        _flag(a, "--disable-cuda-graph", True)
        mtt = mtt or CPU_MAX_TOTAL_TOKENS
    _flag(a, "--max-total-tokens", mtt)
    _flag(a, "--enable-metrics", bool(pool.get("metrics")))
    if "kv_events_port" in plan:
        kv = {
            "publisher": "zmq",
            "endpoint": f"tcp://*:{plan['kv_events_port']}",
            "topic": pool["kv_events_topic"],
        }
        _flag(a, "--kv-events-config", json.dumps(kv, separators=(",", ":")))
    if plan["role"] in ("prefill", "decode") and pool.get("disaggregation", True):
        _flag(a, "--disaggregation-mode", plan["role"])
        _flag(a, "--disaggregation-transfer-backend", pool["transfer_backend"])
        if plan["role"] == "prefill":
            _flag(a, "--disaggregation-bootstrap-port", plan["bootstrap_port"])
        if pool["transfer_backend"] in ("mooncake", "nixl"):
            _flag(a, "--disaggregation-ib-device", ib)
        if plan["role"] == "decode" and device == "cpu":
            _flag(a, "--disaggregation-decode-retraction-backup", "cpu_tensor")
    hc = pool.get("hicache") or {}
    if hc.get("enabled"):
        _flag(a, "--enable-hierarchical-cache", True)
        _flag(a, "--hicache-ratio", hc.get("ratio"))
        _flag(a, "--hicache-size", hc.get("size_gb"))
        _flag(a, "--hicache-write-policy", hc.get("write_policy"))
        _flag(a, "--hicache-mem-layout", hc.get("mem_layout"))
        _flag(a, "--hicache-io-backend", hc.get("io_backend") or ("direct" if device == "cpu" else None))
        _flag(a, "--hicache-storage-backend", hc.get("storage_backend"))
        _flag(a, "--hicache-storage-prefetch-policy", hc.get("prefetch_policy"))
    a.extend(str(x) for x in (launch.get("extra_args") or []))
    a.extend(str(x) for x in pool["extra_args"])
    return a


def _worker_env(
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
    env.update({k: str(v) for k, v in (launch.get("env") or {}).items()})
    env.update({k: str(v) for k, v in (pool.get("env") or {}).items()})
    return env


# --------------------------------------------------------------------------------------------
# public API


def router_config_path(config: Any) -> str:
    launch = _launch(_as_dict(config))
    return str(Path(launch.get("run_dir", ".smetric/run")) / "router-config.yaml")


def resolved_config(config: Any) -> dict[str, Any]:
    """The deployment config the router reads: ``prefill`` / ``decode`` worker lists filled in.

    Each prefill entry has ``url``, ``bootstrap_port``, ``kv_events`` (``tcp://host:port``) and
    ``kv_topic``; each decode entry ``url``; ``mooncake.master`` is set when a master is launched.
    """
    cfg = copy.deepcopy(_as_dict(config))
    launch = _launch(cfg)
    if cfg.get("prefill") or cfg.get("decode"):
        raise LaunchConfigError(
            "with launch.engine: sglang the prefill/decode worker lists are derived from "
            "launch.prefill/launch.decode: remove the top-level prefill:/decode: lists"
        )
    device = launch.get("device", "cuda")
    nodes = {n["name"]: n for n in _nodes(launch, device)}
    prefill, decode = [], []
    pool_cfg = {r: _pool(launch, r) for r in ("prefill", "decode")}
    for p in pools(cfg):
        url = f"http://{p['host']}:{p['port']}"
        if p["role"] == "prefill":
            w: dict[str, Any] = {
                "url": url,
                "bootstrap_port": p["bootstrap_port"],
                "name": p["name"],
                "node": p["node"],
            }
            if "kv_events_port" in p:
                w["kv_events"] = f"tcp://{p['host']}:{p['kv_events_port']}"
                w["kv_topic"] = pool_cfg["prefill"]["kv_events_topic"]
            prefill.append(w)
        else:
            decode.append({"url": url, "name": p["name"], "node": p["node"]})
    cfg["prefill"] = prefill
    cfg["decode"] = decode
    master = _master_address(cfg, launch, nodes)
    if master:
        mc = dict(cfg.get("mooncake") or {})
        mc.setdefault("master", master)
        m = _master(cfg, launch, nodes)
        if m and m.get("http_metadata_port"):
            mc.setdefault("metadata_url", f"http://{m['host']}:{m['http_metadata_port']}/metadata")
        cfg["mooncake"] = mc
    rc = dict(cfg.get("router") or {})
    rnode = (launch.get("router") or {}).get("node") or next(iter(nodes))
    if rnode not in nodes:
        raise LaunchConfigError(f"launch.router.node: unknown node {rnode!r}")
    rc.setdefault("host", _bind_host(launch, list(nodes.values())))
    if isinstance(launch.get("router"), dict) and launch["router"].get("ports"):
        rc["port"] = int(launch["router"]["ports"][0])  # replica 0's; the others get --port
    cfg["router"] = rc
    redis = launch.get("redis")
    if redis:
        rn = redis.get("node") or rnode
        rc.setdefault("redis_url", f"redis://{nodes[rn]['host']}:{redis.get('port', 6379)}/0")
    return cfg


def sglang_argvs(config: Any) -> list[tuple[str, list[str]]]:
    """``(name, argv)`` of every SGLang worker (what tests/test_sglang_args.py parses)."""
    return [(s.name, s.argv) for s in sglang_process_specs(config) if s.role in ("prefill", "decode")]


def sglang_process_specs(config: Any) -> list[ProcessSpec]:
    """Every process of the deployment, in start order.

    mooncake_master and redis first (the workers and router need them), then prefill and
    decode workers, then the router (``smetric router --config <run_dir>/router-config.yaml``,
    a file :func:`resolved_config` gives the content of; the launcher writes it on the router's
    node before starting the router).
    """
    cfg = _as_dict(config)
    launch = _launch(cfg)
    device = launch.get("device", "cuda")
    node_list = _nodes(launch, device)
    nodes = {n["name"]: n for n in node_list}
    bind = _bind_host(launch, node_list)
    plans = pools(cfg)
    pool_cfg = {r: _pool(launch, r) for r in ("prefill", "decode")}
    master_addr = _master_address(cfg, launch, nodes)
    common_env = {k: str(v) for k, v in (launch.get("env") or {}).items()}
    specs: list[ProcessSpec] = []

    m = _master(cfg, launch, nodes)
    if m:
        argv = [
            str(m.get("binary", "mooncake_master")),
            f"--rpc_port={m['rpc_port']}",
            f"--rpc_address={bind if not _is_loopback(m['host']) else m['host']}",
            f"--metrics_port={m['metrics_port']}",
        ]
        if m.get("http_metadata_port"):
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={bind if not _is_loopback(m['host']) else m['host']}",
                f"--http_metadata_server_port={m['http_metadata_port']}",
            ]
        argv += [str(x) for x in m.get("extra_args", [])]
        specs.append(
            ProcessSpec(
                name="mooncake-master",
                role="mooncake_master",
                argv=argv,
                env=dict(common_env),
                host=m["host"],
                node=m["node"],
                ready_port=int(m["rpc_port"]),
            )
        )
    redis = launch.get("redis")
    if redis:
        rn = redis.get("node") or (launch.get("router") or {}).get("node") or node_list[0]["name"]
        if rn not in nodes:
            raise LaunchConfigError(f"launch.redis.node: unknown node {rn!r}")
        port = int(redis.get("port", 6379))
        specs.append(
            ProcessSpec(
                name="redis",
                role="redis",
                argv=replicas.redis_argv(
                    str(redis.get("binary", "redis-server")),
                    port,
                    nodes[rn]["host"] if _is_loopback(nodes[rn]["host"]) else bind,
                    _is_loopback(nodes[rn]["host"]),
                    list(redis.get("extra_args") or []),
                ),
                env=dict(common_env),
                host=nodes[rn]["host"],
                node=rn,
                ready_port=port,
            )
        )
    for p in plans:
        pool = pool_cfg[p["role"]]
        ib = _ib_for(nodes[p["node"]], p["gpus"]) if device != "cpu" else None
        specs.append(
            ProcessSpec(
                name=p["name"],
                role=p["role"],
                argv=_worker_argv(cfg, launch, p, pool, bind, ib),
                env=_worker_env(cfg, launch, p, pool, master_addr, ib),
                host=p["host"],
                node=p["node"],
                ready_url=f"http://{p['host']}:{p['port']}/health",
                ready_port=p["port"],
                gpus=list(p["gpus"]),
            )
        )
    r = launch.get("router")
    r = {"enabled": False} if r is False else (r or {})
    if r.get("enabled", True):
        rnode = r.get("node") or node_list[0]["name"]
        if rnode not in nodes:
            raise LaunchConfigError(f"launch.router.node: unknown node {rnode!r}")
        smetric = r.get("command") or ["smetric"]
        if isinstance(smetric, str):
            smetric = shlex.split(smetric)
        try:
            rports = replicas.replica_ports(cfg)
        except replicas.ReplicaConfigError as e:
            raise LaunchConfigError(str(e)) from None
        for i, port in enumerate(rports):
            # replica i: router.port + i (or launch.router.ports[i]), --replica-id r{i}
            specs.append(
                ProcessSpec(
                    name=replicas.replica_name(i, len(rports)),
                    role="router",
                    argv=[
                        *smetric,
                        "router",
                        "--config",
                        router_config_path(cfg),
                        *replicas.replica_args(i, port, len(rports)),
                        *map(str, r.get("extra_args", [])),
                    ],
                    env=dict(common_env),
                    host=nodes[rnode]["host"],
                    node=rnode,
                    ready_url=f"http://{nodes[rnode]['host']}:{port}/health",
                    ready_port=port,
                )
            )
    return specs


def _shell(spec: ProcessSpec) -> str:
    """One spec as a shell command, one flag per line."""
    lines = []
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
    head = f"env {env} \\\n  " if env else ""
    argv = spec.argv
    i = 1
    while i < len(argv) and not argv[i].startswith("--"):  # program, -m module, subcommand
        i += 1
    parts: list[str] = [" ".join(shlex.quote(t) for t in argv[:i])]
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and "=" not in tok and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            parts.append(f"{tok} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            parts.append(shlex.quote(tok))
            i += 1
    lines.append(head + " \\\n    ".join(parts))
    return "\n".join(lines)


def dry_run_text(config: Any) -> str:
    """Every command with its environment, grouped per node (what ``smetric up --dry-run`` prints).

    The router node's section also shows the router config file the launcher writes there.
    """
    import yaml

    cfg = _as_dict(config)
    launch = _launch(cfg)
    device = launch.get("device", "cuda")
    nodes = _nodes(launch, device)
    specs = sglang_process_specs(cfg)
    out: list[str] = []
    n_p = sum(s.role == "prefill" for s in specs)
    n_d = sum(s.role == "decode" for s in specs)
    out.append(
        f"# engine: sglang ({device}); {len(nodes)} node(s), {n_p} prefill + {n_d} decode instance(s), "
        f"{len(specs)} process(es)"
    )
    for node in nodes:
        mine = [s for s in specs if s.node == node["name"]]
        gpus_used = sorted(g for s in mine for g in s.gpus)
        out.append("")
        out.append(
            f"## node {node['name']} ({node['host']}): {len(mine)} process(es)"
            + (f", GPUs {','.join(map(str, gpus_used))} of {len(node['gpu_ids'])}" if device != "cpu" else "")
        )
        if not mine:
            out.append("# (nothing on this node)")
        for s in mine:
            out.append("")
            extra = f" gpus={','.join(map(str, s.gpus))}" if s.gpus else ""
            ready = s.ready_url or (f"tcp {s.host}:{s.ready_port}" if s.ready_port else "-")
            out.append(f"# {s.name} [{s.role}]{extra} ready: {ready}")
            if s.role == "router" and s.name in ("router", "router-0"):  # one file for all replicas
                body = yaml.safe_dump(resolved_config(cfg), sort_keys=False, width=200)
                path = router_config_path(cfg)
                out.append(
                    f"mkdir -p {shlex.quote(str(Path(path).parent))} && cat > {shlex.quote(path)} <<'EOF'"
                )
                out.append(body.rstrip("\n"))
                out.append("EOF")
            out.append(_shell(s) + " &")
    return "\n".join(out) + "\n"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a deployment YAML as a plain dict (no validation beyond YAML itself)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise LaunchConfigError(f"{path}: top level must be a mapping")
    return data


def main(argv: list[str] | None = None) -> int:
    """``python -m stack.launch.sglang CONFIG [--k8s OUTDIR]``: the dry run (or manifests)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m stack.launch.sglang", description=main.__doc__)
    ap.add_argument("config")
    ap.add_argument("--k8s", metavar="OUTDIR", help="write Kubernetes manifests there instead")
    a = ap.parse_args(argv)
    cfg = replicas.ensure_redis(load_yaml(a.config))  # as `smetric up` does
    if a.k8s:
        from stack.launch.k8s import summary, write_k8s

        print(summary(write_k8s(cfg, a.k8s)), end="")
    else:
        print(dry_run_text(cfg), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
