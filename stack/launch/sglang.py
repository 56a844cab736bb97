"""Real SGLang pools from one deployment YAML: process specs, per-node dry run, router config.

The launcher calls this module when a config says ``launch.engine: sglang``. Everything here is
pure data (no process is started, nothing heavier than PyYAML is imported), so the dry run, the
Kubernetes renderer (``stack.launch.k8s``) and the tests that feed every generated argument list
to SGLang's own parser all see exactly the commands an operator would run.

The work is split by what it is about: reading the ``launch`` section
(``stack.launch.sglang_config``), placing instances on nodes (``stack.launch.sglang_placement``),
one worker's command line (``stack.launch.sglang_worker``), the router processes
(``stack.launch.router_spec``); this module puts them together into the process list and the
router's config. ``python -m stack.launch.dry_run CONFIG [--k8s OUTDIR]`` prints the dry run
(or writes the manifests) without the CLI.

The config is the shared deployment YAML (``stack.config``): ``model``, ``router``, ``mooncake``
as usual; the ``prefill`` / ``decode`` worker lists are *derived* here from the pools described
under ``launch`` (see :func:`resolved_config`) and handed to the router in its own config file.

``launch`` keys (all optional except ``nodes`` and the pool counts; see docs/deploy/bare-metal.md, "The `launch` section")::

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
      kv_tier: hicache             # hicache | lmcache (stack/launch/lmcache_tier.py: launch.lmcache)
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
import shlex
from pathlib import Path
from typing import Any

from stack.launch import lmcache_tier, replicas
from stack.launch.router_spec import drain_grace_s, router_extra_args, router_specs
from stack.launch.sglang_config import (
    LaunchConfigError,
    as_dict,
    is_loopback,
    load_yaml,
    node_list,
    pool_settings,
    section,
    sglang_launch,
)
from stack.launch.sglang_placement import WorkerPlan, pools
from stack.launch.sglang_worker import ib_for, worker_argv, worker_env, worker_key_envs
from stack.launch.spec import ENV_REF, ProcessSpec

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


# --------------------------------------------------------------------------------------------
# helpers for addresses


def _master(cfg: dict[str, Any], launch: dict[str, Any], nodes: dict[str, dict]) -> dict[str, Any] | None:
    """mooncake_master placement; None when no process should be started for it."""
    m = launch.get("mooncake_master", {})
    if m is None or m is False:
        return None
    m = dict(m or {})
    needs = any(
        (pool_settings(launch, r).get("hicache") or {}).get("storage_backend") == "mooncake"
        for r in ("prefill", "decode")
        if launch.get(r) is not None
    ) or (
        lmcache_tier.kv_tier(launch) == "lmcache"
        and lmcache_tier.lmcache_settings(launch)["server"].get("l2") == "mooncake"
    )
    if not m and (not needs or section(cfg, "mooncake").get("master")):
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
    mc = section(cfg, "mooncake")
    if mc.get("master"):
        return str(mc["master"])
    m = _master(cfg, launch, nodes)
    return f"{m['host']}:{m['rpc_port']}" if m else None


def _router_node(launch: dict[str, Any], nodes_in_order: list[dict[str, Any]]) -> str:
    r = launch.get("router")
    return (r.get("node") if isinstance(r, dict) else None) or nodes_in_order[0]["name"]


def _bind_host(launch: dict[str, Any], nodes: list[dict[str, Any]]) -> str:
    if launch.get("bind_host"):
        return str(launch["bind_host"])
    return "127.0.0.1" if all(is_loopback(n["host"]) for n in nodes) else "0.0.0.0"


# --------------------------------------------------------------------------------------------
# public API


def router_config_path(config: Any) -> str:
    launch = sglang_launch(as_dict(config))
    return str(Path(launch.get("run_dir", ".smetric/run")) / "router-config.yaml")


def resolved_config(config: Any) -> dict[str, Any]:
    """The deployment config the router reads: ``prefill`` / ``decode`` worker lists filled in.

    Each prefill entry has ``url``, ``bootstrap_port``, ``kv_events`` (``tcp://host:port``) and
    ``kv_topic``; each decode entry ``url``; ``mooncake.master`` is set when a master is launched.
    """
    cfg = copy.deepcopy(as_dict(config))
    launch = sglang_launch(cfg)
    if cfg.get("prefill") or cfg.get("decode"):
        raise LaunchConfigError(
            "with launch.engine: sglang the prefill/decode worker lists are derived from "
            "launch.prefill/launch.decode: remove the top-level prefill:/decode: lists"
        )
    device = launch.get("device", "cuda")
    nodes = {n["name"]: n for n in node_list(launch, device)}
    prefill, decode = [], []
    pool_cfg = {r: pool_settings(launch, r) for r in ("prefill", "decode")}
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
                if "kv_replay_port" in p:
                    w["kv_replay"] = f"tcp://{p['host']}:{p['kv_replay_port']}"
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
    if lmcache_tier.kv_tier(launch) == "lmcache":
        url = lmcache_tier.controller_url(launch, nodes, rnode)
        if url:
            rc.setdefault("lmcache_controller_url", url)
            rc.setdefault("lmcache_chunk_size", lmcache_tier.lmcache_settings(launch)["chunk_size"])
            if rc.get("global_tier", "mooncake") == "mooncake":
                # HiCache's Mooncake keys mean nothing under LMCache: ask its controller
                rc["global_tier"] = "lmcache"
    redis = launch.get("redis")
    if redis:
        rn = redis.get("node") or rnode
        host = nodes[rn]["host"]
        pw, tls = _redis_auth(redis, host)
        rc.setdefault("redis_url", replicas.redis_url(host, int(redis.get("port", 6379)), tls))
        if pw:  # Redis beyond loopback: the routers read its password from this env var
            rc.setdefault("redis_password_env", pw)
    keys = worker_key_envs(launch)
    if keys:  # the router sends the workers' keys: the same env vars name them
        auth = dict(rc.get("auth") or {})
        if "api_key_env" in keys:
            auth.setdefault("worker_api_key_env", keys["api_key_env"])
        if "admin_api_key_env" in keys:
            auth.setdefault("worker_admin_api_key_env", keys["admin_api_key_env"])
        rc["auth"] = auth
    return cfg


def sglang_argvs(config: Any) -> list[tuple[str, list[str]]]:
    """``(name, argv)`` of every SGLang worker (what tests/integration/test_sglang_args.py parses)."""
    return [(s.name, s.argv) for s in sglang_process_specs(config) if s.role in ("prefill", "decode")]


def _master_spec(m: dict[str, Any], bind: str, env: dict[str, str]) -> ProcessSpec:
    """mooncake_master: on loopback it listens there, elsewhere on the bind address."""
    listen = bind if not is_loopback(m["host"]) else m["host"]
    argv = [
        str(m.get("binary", "mooncake_master")),
        f"--rpc_port={m['rpc_port']}",
        f"--rpc_address={listen}",
        f"--metrics_port={m['metrics_port']}",
    ]
    if m.get("http_metadata_port"):
        argv += [
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={listen}",
            f"--http_metadata_server_port={m['http_metadata_port']}",
        ]
    argv += [str(x) for x in m.get("extra_args", [])]
    return ProcessSpec(
        name="mooncake-master",
        role="mooncake_master",
        argv=argv,
        env=dict(env),
        host=m["host"],
        node=m["node"],
        ready_port=int(m["rpc_port"]),
    )


def _redis_auth(redis: dict[str, Any], host: str) -> tuple[str | None, dict[str, str] | None]:
    """(password env var or None, TLS files or None) of the Redis ``launch.redis`` on ``host``."""
    try:
        return replicas.redis_password_env(redis, is_loopback(host)), replicas.redis_tls(redis)
    except replicas.ReplicaConfigError as e:
        raise LaunchConfigError(str(e)) from None


def _redis_spec(
    launch: dict[str, Any], nodes_in_order: list[dict[str, Any]], bind: str, env: dict[str, str]
) -> ProcessSpec:
    """The router replicas' Redis: on ``launch.redis.node``, else the router's node, else the first."""
    nodes = {n["name"]: n for n in nodes_in_order}
    redis = launch["redis"]
    rn = redis.get("node") or (launch.get("router") or {}).get("node") or nodes_in_order[0]["name"]
    if rn not in nodes:
        raise LaunchConfigError(f"launch.redis.node: unknown node {rn!r}")
    host = nodes[rn]["host"]
    port = int(redis.get("port", 6379))
    pw, tls = _redis_auth(redis, host)
    return ProcessSpec(
        name="redis",
        role="redis",
        argv=replicas.redis_argv(
            str(redis.get("binary", "redis-server")),
            port,
            host if is_loopback(host) else bind,
            is_loopback(host),
            list(redis.get("extra_args") or []),
            pw,
            tls,
        ),
        env=dict(env),
        host=host,
        node=rn,
        ready_port=port,
        secret_env=[pw] if pw else [],
    )


def _router_specs(
    cfg: dict[str, Any], launch: dict[str, Any], nodes_in_order: list[dict[str, Any]], env: dict[str, str]
) -> list[ProcessSpec]:
    """``smetric router`` replicas on the router node (none when ``launch.router`` disables it).

    The command is ``launch.router.command`` (a list, or a string split as a shell would),
    default ``smetric`` on the node's PATH.
    """
    r = launch.get("router")
    r = {"enabled": False} if r is False else (r or {})
    if not r.get("enabled", True):
        return []
    nodes = {n["name"]: n for n in nodes_in_order}
    rnode = r.get("node") or nodes_in_order[0]["name"]
    if rnode not in nodes:
        raise LaunchConfigError(f"launch.router.node: unknown node {rnode!r}")
    smetric = r.get("command") or ["smetric"]
    if isinstance(smetric, str):
        smetric = shlex.split(smetric)
    try:
        rports = replicas.replica_ports(cfg)
    except replicas.ReplicaConfigError as e:
        raise LaunchConfigError(str(e)) from None
    specs = router_specs(
        command=smetric,
        config_path=router_config_path(cfg),
        ports=rports,
        host=nodes[rnode]["host"],
        node=rnode,
        env=env,
        extra_args=router_extra_args(r),
        stop_grace_s=drain_grace_s(cfg.get("router") or {}),
    )
    redis = launch.get("redis")
    pw = None
    if redis:  # Redis beyond loopback: the routers need its password too
        rn = redis.get("node") or rnode
        pw = _redis_auth(redis, nodes[rn]["host"] if rn in nodes else "127.0.0.1")[0]
    for s in specs:  # it reads the workers' keys from the same env vars
        s.secret_env = list(worker_key_envs(launch).values()) + ([pw] if pw else [])
    return specs


def sglang_process_specs(config: Any) -> list[ProcessSpec]:
    """Every process of the deployment, in start order.

    mooncake_master and redis first (the workers and router need them), with ``kv_tier:
    lmcache`` an LMCache server per worker node and the LMCache controller, then prefill and
    decode workers, then the router (``smetric router --config <run_dir>/router-config.yaml``,
    a file :func:`resolved_config` gives the content of; the launcher writes it on the router's
    node before starting the router).
    """
    cfg = as_dict(config)
    launch = sglang_launch(cfg)
    device = launch.get("device", "cuda")
    nodes_in_order = node_list(launch, device)
    nodes = {n["name"]: n for n in nodes_in_order}
    bind = _bind_host(launch, nodes_in_order)
    plans = pools(cfg)
    pool_cfg = {r: pool_settings(launch, r) for r in ("prefill", "decode")}
    master_addr = _master_address(cfg, launch, nodes)
    common_env = {k: str(v) for k, v in (launch.get("env") or {}).items()}
    specs: list[ProcessSpec] = []

    m = _master(cfg, launch, nodes)
    if m:
        specs.append(_master_spec(m, bind, common_env))
    if launch.get("redis"):
        specs.append(_redis_spec(launch, nodes_in_order, bind, common_env))
    lmcache = lmcache_tier.kv_tier(launch) == "lmcache"
    if lmcache:
        lmcache_tier.check_pools(launch)
        used = list(dict.fromkeys(p["node"] for p in plans))
        specs += lmcache_tier.server_specs(launch, nodes, used, bind, master_addr, common_env)
        ctl = lmcache_tier.controller_spec(
            launch, nodes, _router_node(launch, nodes_in_order), bind, common_env
        )
        if ctl is not None:
            specs.append(ctl)
    for p in plans:
        pool = pool_cfg[p["role"]]
        ib = ib_for(nodes[p["node"]], p["gpus"]) if device != "cpu" else None
        files = {}
        if lmcache:
            path = lmcache_tier.config_file_path(launch, p["node"])
            files[path] = lmcache_tier.config_file_text(launch, p["host"])
        specs.append(
            ProcessSpec(
                name=p["name"],
                role=p["role"],
                argv=worker_argv(cfg, launch, p, pool, bind, ib),
                env=worker_env(cfg, launch, p, pool, master_addr, ib),
                host=p["host"],
                node=p["node"],
                ready_url=f"http://{p['host']}:{p['port']}/health",
                ready_port=p["port"],
                gpus=list(p["gpus"]),
                files=files,
                secret_env=list(worker_key_envs(launch).values()),
            )
        )
    specs += _router_specs(cfg, launch, nodes_in_order, common_env)
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
            parts.append(f"{tok} {_quote(argv[i + 1], spec.secret_env)}")
            i += 2
        else:
            parts.append(_quote(tok, spec.secret_env))
            i += 1
    lines.append(head + " \\\n    ".join(parts))
    return "\n".join(lines)


def _quote(tok: str, secrets: list[str]) -> str:
    """``tok`` for a shell; a secret's ``$(NAME)`` becomes ``"$NAME"`` (the shell expands it)."""
    m = ENV_REF.fullmatch(tok)
    if m and m[1] in secrets:
        return f'"${m[1]}"'
    return shlex.quote(tok)


def dry_run_text(config: Any) -> str:
    """Every command with its environment, grouped per node (what ``smetric up --dry-run`` prints).

    The router node's section also shows the router config file the launcher writes there.
    """
    cfg = as_dict(config)
    launch = sglang_launch(cfg)
    device = launch.get("device", "cuda")
    nodes = node_list(launch, device)
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
            out.append(spec_text(cfg, s))
    return "\n".join(out) + "\n"


def spec_text(config: Any, s: ProcessSpec) -> str:
    """One process of :func:`dry_run_text`: its header, the router config file for the (first)
    router, and the command (``stack.launch.role --dry-run`` prints the same blocks)."""
    import yaml

    cfg = as_dict(config)
    out: list[str] = []
    extra = f" gpus={','.join(map(str, s.gpus))}" if s.gpus else ""
    ready = s.ready_url or (f"tcp {s.host}:{s.ready_port}" if s.ready_port else "-")
    out.append(f"# {s.name} [{s.role}]{extra} ready: {ready}")
    for path, text in s.files.items():
        out.append(f"mkdir -p {shlex.quote(str(Path(path).parent))} && cat > {shlex.quote(path)} <<'EOF'")
        out.append(text.rstrip("\n"))
        out.append("EOF")
    if s.role == "router" and s.name in ("router", "router-0"):  # one file for all replicas
        body = yaml.safe_dump(resolved_config(cfg), sort_keys=False, width=200)
        path = router_config_path(cfg)
        out.append(f"mkdir -p {shlex.quote(str(Path(path).parent))} && cat > {shlex.quote(path)} <<'EOF'")
        out.append(body.rstrip("\n"))
        out.append("EOF")
    out.append(_shell(s) + " &")
    return "\n".join(out)


if __name__ == "__main__":  # the old entry point: say where it went rather than print nothing
    raise SystemExit(
        "python -m stack.launch.sglang has moved: python -m stack.launch.dry_run CONFIG [--k8s OUTDIR]"
    )
