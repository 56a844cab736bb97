"""The local PD stack with emulated workers: process specs and the router's resolved config.

Reads the same ``launch`` keys as the real-SGLang builder (``stack.launch.sglang``) where they
apply, all on one machine (``bind_host``, loopback by default)::

    launch:
      engine: emulate
      run_dir: .smetric/run
      bind_host: 127.0.0.1
      ports: fixed | auto          # auto: every port picked free at start
      prefill: {count: 4, port: 30000, bootstrap_port: 8998, kv_events_port: 5557,
                kv_events_topic: kv, port_stride: 10, workers_per_process: 1}
      decode:  {count: 2, port: 31000, port_stride: 10, workers_per_process: 1}
                                   # workers_per_process > 1: that many workers share one
                                   # process and event loop, each still its own endpoint,
                                   # KV-event publisher and Mooncake clients
      mooncake_master: {rpc_port: 50051, http_metadata_port: 8080, metrics_port: 9003}
                                   # null / false: no master, workers without a global tier
      mooncake_store: {global_segment_bytes: 268435456}
      router: {enabled: true, extra_args: [], replicas: 1, ports: [...]}
                                   # replicas > 1: router.port + i (or ports[i]), --replica-id r{i},
                                   # one shared Redis (stack/launch/replicas.py)
      redis: {port: 6379, binary: redis-server, extra_args: []}
                                   # started when set; with replicas > 1 and no redis/redis_url:
                                   # started on router.port + 379 (a free port with ports: auto)
      emulator: {...}              # stack.worker.settings.WorkerSettings fields
      kv_tier: hicache | lmcache   # lmcache: an LMCache engine per prefill worker and the
      lmcache: {...}               # controller (stack/launch/emulated_lmcache.py)
      sglang: {api_key_env: NAME, admin_api_key_env: NAME}
                                   # the workers' --api-key / --admin-api-key from these env
                                   # vars, as for real SGLang workers; the router sends them

Pure data: nothing is started and nothing heavy is imported here.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from stack.launch import emulated_lmcache, replicas
from stack.launch.router_spec import drain_grace_s, router_extra_args, router_specs
from stack.launch.sglang_worker import worker_key_args, worker_key_envs
from stack.launch.spec import ProcessSpec, kv_replay_base
from stack.ports import free_port

DEFAULTS = {
    "prefill": {"count": 4, "port": 30000, "bootstrap_port": 8998, "kv_events_port": 5557, "port_stride": 10},
    "decode": {"count": 2, "port": 31000, "port_stride": 10},
    "mooncake_master": {"rpc_port": 50051, "http_metadata_port": 8080, "metrics_port": 9003},
}


def launch_section(cfg: dict[str, Any]) -> dict[str, Any]:
    launch = cfg.get("launch") or {}
    if not isinstance(launch, dict):
        raise ValueError("launch: must be a mapping")
    return launch


def run_dir_of(cfg: dict[str, Any]) -> Path:
    return Path(launch_section(cfg).get("run_dir", ".smetric/run"))


def plan(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every port and address of the local stack, with ``ports: auto`` resolved to free ports.

    Returns ``{"host", "master": {...} | None, "prefill": [...], "decode": [...], "router": {...},
    "redis": {...} | None}``; ``router.ports`` has one port per replica.
    """
    launch = launch_section(cfg)
    host = str(launch.get("bind_host", "127.0.0.1"))
    auto = str(launch.get("ports", "fixed")) == "auto"

    def port(v: int) -> int:  # free_port never hands out a port twice
        return free_port(host) if auto else int(v)

    out: dict[str, Any] = {"host": host}
    m = launch.get("mooncake_master", DEFAULTS["mooncake_master"])
    if m is None or m is False:
        out["master"] = None
    else:
        m = {**DEFAULTS["mooncake_master"], **(m or {})}
        out["master"] = {k: port(m[k]) for k in ("rpc_port", "http_metadata_port", "metrics_port")}
        out["master"]["binary"] = m.get("binary", "mooncake_master")
        out["master"]["extra_args"] = [str(x) for x in m.get("extra_args", [])]
    dec = {**DEFAULTS["decode"], **(launch.get("decode") or {})}
    colocated = (launch.get("prefill") or {}).get("disaggregation") is False or int(dec["count"]) == 0
    for role in ("prefill", "decode"):
        pool = {**DEFAULTS[role], **(launch.get(role) or {})}
        stride = int(pool.get("port_stride", 10))
        items = []
        for i in range(int(pool["count"])):
            it = {
                "name": f"{role}-{i}",
                "role": role,
                "index": i,
                "host": host,
                "port": port(int(pool["port"]) + i * stride),
            }
            if role == "prefill":
                # no decode pool (or disaggregation: false): the pool prefills and decodes
                it["mode"] = "colocated" if colocated else "prefill"
                it["bootstrap_port"] = port(int(pool["bootstrap_port"]) + i * stride)
                if pool.get("kv_events_port") is not None:
                    it["kv_events_port"] = port(int(pool["kv_events_port"]) + i * stride)
                    it["kv_events_topic"] = str(pool.get("kv_events_topic", "kv"))
                    replay = kv_replay_base(pool, stride)
                    if replay is not None:
                        it["kv_replay_port"] = port(replay + i * stride)
            items.append(it)
        out[role] = items
    if emulated_lmcache.enabled(launch):  # docs/research/lmcache.md
        out["lmcache"] = emulated_lmcache.plan(launch, out["prefill"], out["master"], port)
    r = launch.get("router", {})
    router_cfg = cfg.get("router") or {}
    enabled = r is not False and (r or {}).get("enabled", True)
    if enabled:
        rports = [port(x) for x in replicas.replica_ports(cfg)]
    else:
        rports = [port(int(router_cfg.get("port", 8000)))]
    out["router"] = {
        "enabled": bool(enabled),
        "host": str(router_cfg.get("host", host)),
        "port": rports[0],
        "ports": rports,  # one per replica (launch.router.replicas)
        "extra_args": router_extra_args(r) if enabled else [],
    }
    rd = launch.get("redis")
    if rd and enabled:
        if not isinstance(rd, dict):
            raise ValueError("launch.redis: must be a mapping ({port: ...})")
        out["redis"] = {
            "port": port(int(rd.get("port", 6379))),
            "binary": str(rd.get("binary", "redis-server")),
            "extra_args": [str(x) for x in rd.get("extra_args", [])],
            "auto": bool(rd.get("auto", False)),
            # beyond loopback a password (replicas.redis_password_env); TLS when asked
            "password_env": replicas.redis_password_env(rd, _loopback(host)),
            "tls": replicas.redis_tls(rd),
        }
    else:
        out["redis"] = None
    return out


def workers_per_process(launch: dict[str, Any], role: str) -> int:
    """``launch.<role>.workers_per_process`` (default 1: a process per worker)."""
    n = (launch.get(role) or {}).get("workers_per_process", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"launch.{role}.workers_per_process must be a positive integer, not {n!r}")
    return n


def all_ports(p: dict[str, Any]) -> list[tuple[str, int]]:
    """(what, port) of every port the plan binds, for an up-front availability check."""
    out: list[tuple[str, int]] = []
    if p.get("master"):
        out += [
            (f"mooncake_master.{k}", p["master"][k])
            for k in ("rpc_port", "http_metadata_port", "metrics_port")
        ]
    for role in ("prefill", "decode"):
        for it in p[role]:
            for k in ("port", "bootstrap_port", "kv_events_port", "kv_replay_port"):
                if k in it:
                    out.append((f"{it['name']}.{k}", it[k]))
    if p.get("lmcache"):
        out += emulated_lmcache.ports(p["lmcache"])
    if p.get("redis"):
        out.append(("redis.port", p["redis"]["port"]))
    if p["router"]["enabled"]:
        ports = p["router"].get("ports") or [p["router"]["port"]]
        if len(ports) == 1:
            out.append(("router.port", ports[0]))
        else:
            out += [(f"router-{i}.port", x) for i, x in enumerate(ports)]
    return out


def router_config_path(cfg: dict[str, Any]) -> Path:
    return run_dir_of(cfg) / "router-config.yaml"


def resolved_config(cfg: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """The deployment config the router reads (``stack.config`` schema), worker lists filled in."""
    out = copy.deepcopy(cfg)
    out["prefill"] = [
        {
            "url": f"http://{it['host']}:{it['port']}",
            "bootstrap_port": it["bootstrap_port"],
            "name": it["name"],
            **(
                {
                    "kv_events": f"tcp://{it['host']}:{it['kv_events_port']}",
                    "kv_topic": it["kv_events_topic"],
                    "kv_replay": f"tcp://{it['host']}:{it['kv_replay_port']}"
                    if "kv_replay_port" in it
                    else None,
                }
                if "kv_events_port" in it
                else {"kv_events": None}
            ),
        }
        for it in p["prefill"]
    ]
    out["decode"] = [{"url": f"http://{it['host']}:{it['port']}", "name": it["name"]} for it in p["decode"]]
    if p.get("master"):
        mc = dict(out.get("mooncake") or {})
        mc["master"] = f"{p['host']}:{p['master']['rpc_port']}"
        mc["metadata_url"] = f"http://{p['host']}:{p['master']['http_metadata_port']}/metadata"
        out["mooncake"] = mc
    rc = dict(out.get("router") or {})
    rc["host"] = p["router"]["host"]
    rc["port"] = p["router"]["port"]
    # the router's clock runs at the emulated pool's modelled time (router.time_factor)
    tf = ((cfg.get("launch") or {}).get("emulator") or {}).get("time_factor")
    if tf is not None:
        rc.setdefault("time_factor", float(tf))
    if p.get("redis"):
        rc.setdefault("redis_url", redis_url(p))
        if p["redis"].get("password_env"):
            rc.setdefault("redis_password_env", p["redis"]["password_env"])
    if p.get("lmcache"):
        rc.update(emulated_lmcache.router_settings(p["lmcache"], p["host"]))
    keys = worker_key_envs(cfg.get("launch") or {})
    if keys:  # the router sends the workers' keys, named by the same env vars
        auth = dict(rc.get("auth") or {})
        for field, router_field in (
            ("api_key_env", "worker_api_key_env"),
            ("admin_api_key_env", "worker_admin_api_key_env"),
        ):
            if field in keys:
                auth.setdefault(router_field, keys[field])
        rc["auth"] = auth
    out["router"] = rc
    return out


def redis_url(p: dict[str, Any]) -> str | None:
    """URL of the Redis the plan starts (None: none)."""
    if not p.get("redis"):
        return None
    return replicas.redis_url(p["host"], p["redis"]["port"], p["redis"].get("tls"))


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def _python() -> list[str]:
    return [sys.executable, "-m", "stack.cli"]


def redis_spec(rd: dict[str, Any], host: str, env: dict[str, str]) -> ProcessSpec:
    """redis-server for the router replicas: no persistence (nothing written to the cwd), a
    password beyond loopback (its env var a secret of the spec: never in the spec itself)."""
    pw = rd.get("password_env")
    return ProcessSpec(
        name="redis",
        role="redis",
        argv=replicas.redis_argv(
            rd["binary"], rd["port"], host, _loopback(host), rd["extra_args"], pw, rd.get("tls")
        ),
        env=dict(env),
        host=host,
        ready_port=rd["port"],
        secret_env=[pw] if pw else [],
    )


def process_specs(cfg: dict[str, Any], p: dict[str, Any], router_config: str | Path) -> list[ProcessSpec]:
    """mooncake_master and redis (kv_tier lmcache: the LMCache controller and engines), then
    prefill and decode emulated workers, then the router(s)."""
    launch = launch_section(cfg)
    env = {k: str(v) for k, v in (launch.get("env") or {}).items()}
    env.setdefault("GLOG_minloglevel", "1")  # Mooncake's glog: warnings and up
    specs: list[ProcessSpec] = []
    host = p["host"]
    m = p.get("master")
    if m:
        specs.append(master_spec(m, host, env))
    rd = p.get("redis")
    if rd:
        specs.append(redis_spec(rd, host, env))
    lm = p.get("lmcache")
    if lm:
        specs += emulated_lmcache.specs(lm, host, m["rpc_port"], env)

    # the router sends SGLang priorities (router.dispatch.sglang_priority): the emulated
    # workers honour them as SGLang run with launch.sglang.priority_scheduling would
    dispatch = ((cfg.get("router") or {}).get("dispatch")) or {}
    prio = ["--enable-priority-scheduling", "--disable-priority-preemption"]
    prio = prio if dispatch.get("sglang_priority") is True else []
    if prio:  # /v1/messages carries it in the x-override-priority header (as for SGLang)
        env.setdefault("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "1")

    def argv_of(it: dict[str, Any]) -> list[str]:
        return worker_argv(it, cfg.get("model") or {}, launch, p) + prio

    for role in ("prefill", "decode"):
        specs += worker_specs(role, p[role], workers_per_process(launch, role), env, argv_of, launch)
    r = p["router"]
    if r["enabled"]:
        routers = router_specs(
            command=_python(),
            config_path=str(router_config),
            ports=r.get("ports") or [r["port"]],
            host=r["host"],
            env=env,
            extra_args=r["extra_args"],
            stop_grace_s=drain_grace_s(cfg.get("router") or {}),
        )
        pw = (p.get("redis") or {}).get("password_env")
        for s in routers if pw else []:  # the launcher starts no router without the password
            s.secret_env.append(pw)
        specs += routers
    return specs


def master_spec(m: dict[str, Any], host: str, env: dict[str, str]) -> ProcessSpec:
    """mooncake_master with its HTTP metadata server, on ``host``."""
    return ProcessSpec(
        name="mooncake-master",
        role="mooncake_master",
        argv=[
            m["binary"],
            f"--rpc_port={m['rpc_port']}",
            f"--rpc_address={host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={m['http_metadata_port']}",
            f"--metrics_port={m['metrics_port']}",
            f"--metrics_host={host}",
            "--rpc_thread_num=2",
            *m["extra_args"],
        ],
        env=dict(env),
        host=host,
        ready_port=m["rpc_port"],
    )


#: emulator settings (``launch.emulator``) passed on as worker flags when set
_EMULATOR_FLAGS = {
    "hardware": "--hardware",
    "time_factor": "--time-factor",
    "capacity_tokens": "--capacity-tokens",
    "chunk_tokens": "--chunk-tokens",
    "decode_tpot_s": "--decode-tpot-s",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "bootstrap_timeout_s": "--bootstrap-timeout-s",
    "kv_transport": "--kv-transport",
    "stream_interval": "--stream-interval",
    "link_file": "--link-file",
}


def worker_argv(
    it: dict[str, Any], model: dict[str, Any], launch: dict[str, Any], p: dict[str, Any]
) -> list[str]:
    """The ``smetric worker --emulate`` command line of one planned worker ``it``."""
    emu = launch.get("emulator") or {}
    store = launch.get("mooncake_store") or {}
    host, m, lm = p["host"], p.get("master"), p.get("lmcache")
    a = [
        *_python(),
        "worker",
        "--emulate",
        "--mode",
        it.get("mode", it["role"]),
        "--host",
        it["host"],
        "--port",
        str(it["port"]),
        "--name",
        it["name"],
    ]
    if model.get("name"):
        a += ["--model", str(model["name"])]
    if model.get("path"):
        a += ["--tokenizer", str(model["path"])]
    if model.get("page_size"):
        a += ["--page-size", str(model["page_size"])]
    if model.get("tool_call_parser"):
        a += ["--tool-call-parser", str(model["tool_call_parser"])]
    if it["role"] == "prefill":
        a += ["--bootstrap-port", str(it["bootstrap_port"])]
        if "kv_events_port" in it:
            a += [
                "--kv-events-endpoint",
                f"tcp://{it['host']}:{it['kv_events_port']}",
                "--kv-events-topic",
                it["kv_events_topic"],
            ]
            if "kv_replay_port" in it:
                a += ["--kv-events-replay-endpoint", f"tcp://{it['host']}:{it['kv_replay_port']}"]
    if m:
        a += [
            "--mooncake-master",
            f"{host}:{m['rpc_port']}",
            "--mooncake-metadata",
            f"http://{host}:{m['http_metadata_port']}/metadata",
        ]
        if store.get("global_segment_bytes"):
            a += ["--store-segment-bytes", str(int(store["global_segment_bytes"]))]
    for k, flag in _EMULATOR_FLAGS.items():
        if emu.get(k) is not None:
            a += [flag, str(emu[k])]
    if emu.get("model_fetch_time") is False:
        a.append("--no-fetch-time")
    if emu.get("enable_metrics"):  # meta_info with the prefill's own timings (router.cost_model)
        a.append("--enable-metrics")
    if lm and it["role"] == "prefill":
        a += emulated_lmcache.worker_args(lm, it["host"], it["index"])
    return a


def worker_specs(
    role: str,
    items: list[dict[str, Any]],
    per: int,
    env: dict[str, str],
    argv_of,
    launch: dict[str, Any] | None = None,
) -> list[ProcessSpec]:
    """One process per ``per`` workers of ``role``: alone, its own command line; grouped, one
    ``--pool`` process (one event loop, each worker its own endpoint: serve_many).

    The workers' keys (``launch.sglang.api_key_env`` / ``admin_api_key_env``, as for real
    SGLang workers) go on as ``--api-key $(NAME)``: after the member list of a pool (flags
    outside ``--pool`` apply to every member), so a key is never spliced into its JSON; the
    launcher substitutes the value when it starts the process."""
    keys = worker_key_args(launch or {})
    secrets = list(worker_key_envs(launch or {}).values())
    specs = []
    for g in range(0, len(items), per):
        group = items[g : g + per]
        urls = [f"http://{it['host']}:{it['port']}/health" for it in group]
        if len(group) == 1:
            name, argv = group[0]["name"], argv_of(group[0])
        else:
            name = f"{role}-{group[0]['index']}..{group[-1]['index']}"
            members = [argv_of(it)[len(_python()) + 2 :] for it in group]
            argv = [*_python(), "worker", "--emulate", "--pool", json.dumps(members)]
        argv = [*argv, *keys]
        specs.append(
            ProcessSpec(
                name=name,
                role=role,
                argv=argv,
                env=dict(env),
                host=group[0]["host"],
                ready_url=urls[0],
                also_ready=urls[1:],
                ready_port=group[0]["port"],
                secret_env=list(secrets),
            )
        )
    return specs
