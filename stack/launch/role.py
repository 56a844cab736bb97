"""``python -m stack.launch.role ROLE [start|stop|status] --config FILE [--node NODE] [--dry-run]``.

The per-node, per-role entry of the launcher, behind the operator scripts in ``launch/``
(``launch/prefill-pool.sh`` is ``python3 -m stack.launch.role prefill "$@"``). It builds the
deployment's processes exactly as ``smetric up`` does (:func:`stack.launch.cli.build`: for
``launch.engine: sglang`` :func:`stack.launch.sglang.sglang_process_specs`, for ``emulate`` the
emulated plan) and keeps those of one role, and with ``--node`` those placed on that node (its
name or host). Nothing here builds a command, so the scripts, ``smetric up``, the dry run and
the Kubernetes manifests cannot disagree.

- ``--dry-run``: print what ``start`` would run, per node, in the text of
  ``python -m stack.launch.dry_run`` / ``smetric up --dry-run`` (``--format json``: the specs).
- ``start`` (default): start them here, each in its own process group, PID files under
  ``<run_dir>/pids/``, logs under ``<run_dir>/logs/`` (:mod:`stack.launch.process`); wait until
  each is ready; return (the processes keep running). If one fails, what was started is
  stopped again and the exit status is 1.
- ``stop``: stop exactly the processes of this role (and node) recorded in the run dir:
  SIGTERM to each process group, SIGKILL after ``--grace`` seconds.
- ``status``: each process of the role: running or not, ready or not (exit 3 if any is not
  running).

Without ``--node``, a role placed on several nodes is narrowed to the node this machine is
(its host name or one of its addresses equals a node's name or host); ``start`` refuses to
guess beyond that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from stack.launch.process import Managed, RunDir, probe, start, stop_groups, tail
from stack.launch.spec import ProcessSpec, ready_timeout_s
from stack.ports import port_free

__all__ = ["ROLES", "main", "role_specs", "dry_run_text"]

#: the roles a script can start (ProcessSpec.role), in the order a deployment starts them
ROLES = ("mooncake_master", "redis", "lmcache_server", "lmcache_controller", "prefill", "decode", "router")
_ALIASES = {
    "mooncake-master": "mooncake_master",
    "lmcache-server": "lmcache_server",
    "lmcache-controller": "lmcache_controller",
    "prefill-pool": "prefill",
    "decode-pool": "decode",
}
_SCRIPTS = {
    "mooncake_master": "launch/mooncake-master.sh",
    "redis": "launch/redis.sh",
    "lmcache_server": "launch/lmcache-server.sh",
    "lmcache_controller": "launch/lmcache-controller.sh",
    "prefill": "launch/prefill-pool.sh",
    "decode": "launch/decode-pool.sh",
    "router": "launch/router.sh",
}
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RoleError(ValueError):
    """The role cannot be selected or started as asked (a readable one-line reason)."""


def _load(config: str | None, run_dir: str | None) -> dict[str, Any]:
    from stack.launch import cli

    ns = argparse.Namespace(
        config=config,
        run_dir=run_dir,
        ports=None,
        prefill=None,
        decode=None,
        no_router=False,
        router_replicas=None,
        policy=None,
        no_mooncake=False,
        time_factor=None,
    )
    return cli.load(ns)


def _engine(cfg: dict[str, Any]) -> str:
    e = str(cfg["launch"].get("engine", "emulate"))
    return "emulate" if e == "emulated" else e


def build(cfg: dict[str, Any], dry_run: bool) -> tuple[list[ProcessSpec], dict[str, Any], Path]:
    """Every spec of the deployment (as ``smetric up`` builds them), router config and its path."""
    from stack.launch import cli

    # sglang: the per-node specs (cli.build refuses non-local hosts unless dry_run, which is
    # all that flag changes there); emulate: dry_run=False builds the tiny tokenizer if needed
    specs, rcfg, rpath, _ = cli.build(cfg, dry_run=dry_run or _engine(cfg) == "sglang")
    return specs, rcfg, rpath


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        host = socket.gethostname()
        names |= {host, host.split(".")[0], socket.getfqdn()}
        for info in socket.getaddrinfo(host, None):
            names.add(str(info[4][0]))
    except OSError:
        pass
    return names


def role_specs(specs: list[ProcessSpec], role: str, node: str | None = None) -> list[ProcessSpec]:
    """The specs of ``role`` (in launcher order), with ``node`` those whose node or host it is."""
    mine = [s for s in specs if s.role == role]
    if node is not None:
        mine = [s for s in mine if node in (s.node, s.host)]
    return mine


def _nodes(specs: list[ProcessSpec]) -> list[str]:
    out: list[str] = []
    for s in specs:
        if s.node not in out:
            out.append(s.node)
    return out


def dry_run_text(cfg: dict[str, Any], specs: list[ProcessSpec], rcfg: dict[str, Any], rpath: Path) -> str:
    """The selected specs, grouped per node, each in the launcher's own dry-run text."""
    clean = {k: v for k, v in cfg.items() if k != "_source"}
    engine = _engine(cfg)
    out = [f"# engine: {engine}; {len(specs)} process(es)"]
    if engine == "sglang":
        from stack.launch import sglang

        def block(s: ProcessSpec) -> str:
            return sglang.spec_text(clean, s)
    else:
        from stack.launch import cli

        if any(s.role == "router" for s in specs):
            out.append(cli.router_config_text(rcfg, rpath))

        def block(s: ProcessSpec) -> str:
            return cli.emulated_spec_text(s)

    for node in _nodes(specs):
        mine = [s for s in specs if s.node == node]
        out.append("")
        out.append(f"## node {node} ({mine[0].host}): {len(mine)} process(es)")
        for s in mine:
            out.append("")
            out.append(block(s))
    return "\n".join(out) + "\n"


def _select(args: argparse.Namespace) -> tuple[dict[str, Any], list[ProcessSpec], dict[str, Any], Path]:
    cfg = _load(args.config, args.run_dir)
    launch = cfg["launch"]
    if args.action == "start" and not args.dry_run and _engine(cfg) == "emulate":
        if str(launch.get("ports", "fixed")) == "auto":
            raise RoleError(
                "launch.ports: auto picks new ports on every run, so the roles would not find "
                "each other: give the config fixed ports to start it role by role"
            )
    specs, rcfg, rpath = build(cfg, dry_run=args.dry_run or args.action != "start")
    everything = role_specs(specs, args.role)
    if not everything:
        raise RoleError(f"{args.config or 'the config'} starts no {args.role} process")
    node = args.node
    if node is None and len(_nodes(everything)) > 1:
        local = _local_names()
        here = [
            n
            for n in _nodes(everything)
            if n in local or any(s.host in local for s in everything if s.node == n)
        ]
        if len(here) == 1:
            node = here[0]
        elif args.action != "status" and not args.dry_run:
            raise RoleError(
                f"{args.role} runs on {len(_nodes(everything))} nodes ({', '.join(_nodes(everything))}): "
                "pass --node NAME for the one this is"
            )
    mine = role_specs(everything, args.role, node)
    if not mine:
        raise RoleError(
            f"no {args.role} process on node {node} (it runs on: {', '.join(_nodes(everything))})"
        )
    return cfg, mine, rcfg, rpath


def _start(cfg: dict[str, Any], specs: list[ProcessSpec], rcfg: dict[str, Any], rpath: Path, args) -> int:
    from stack.launch import cli

    launch = cfg["launch"]
    run = RunDir(Path(launch.get("run_dir", ".smetric/run")))
    cli.check_commands(specs)
    names = {s.name for s in specs}
    live = [r["name"] for r in run.live_records() if r["name"] in names]
    if live:
        raise RoleError(f"already running from {run.path}: {', '.join(live)} (stop it first)")
    busy = [b for b in launch.get("_busy", []) if b.split("=")[0].rsplit(".", 1)[0] in names | {args.role}]
    if _engine(cfg) == "sglang":
        busy = [
            f"{s.name}.port={s.ready_port}"
            for s in specs
            if s.ready_port and not port_free("0.0.0.0", s.ready_port)
        ]
    if busy:
        raise RoleError(f"ports in use: {', '.join(busy)}")
    run.ensure()
    for r in run.records():
        if r["name"] in names:
            run.remove(r["name"])  # dead: checked above
    if args.role == "router":
        cli.write_router_config(rcfg, rpath)
    seq = max((int(r.get("seq", 0)) for r in run.records()), default=-1) + 1
    timeout = ready_timeout_s(launch, args.ready_timeout)
    started: list[Managed] = []
    old = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}

    def _raise(signum, frame):
        raise KeyboardInterrupt

    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise)
    try:
        for s in specs:
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # no orphan before its PID file
            try:
                started.append(start(s, run, seq))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            seq += 1
            print(
                f"started {s.name} [{s.role}] pid {started[-1].pid}, log {started[-1].log}", file=sys.stderr
            )
        deadline = time.monotonic() + timeout
        pending = list(started)
        while pending:
            for m in list(pending):
                if not m.alive():
                    raise RuntimeError(f"{m.spec.name} exited during startup (log {m.log}):\n{tail(m.log)}")
                if probe(m.spec, timeout=5.0):
                    pending.remove(m)
                    where = m.spec.ready_url or f"{m.spec.host}:{m.spec.ready_port}"
                    print(f"ready {m.spec.name} ({where})", file=sys.stderr)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"not ready after {timeout:.0f} s: {', '.join(m.spec.name for m in pending)} "
                    f"(logs in {run.logs}):\n{tail(pending[0].log)}"
                )
            if pending:
                time.sleep(0.2)
    except (RuntimeError, KeyboardInterrupt) as e:
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"startup failed: {e}"
        print(f"{args.role}: {why}; stopping what was started", file=sys.stderr)
        recs = [r for r in run.records() if r["name"] in names]
        stop_groups(recs, run, grace_s=float(launch.get("stop_grace_s", 10.0)))
        for m in started:
            if m.popen is not None:
                try:
                    m.popen.wait(timeout=1)
                except Exception:  # noqa: BLE001 - never hang here
                    pass
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    from stack.launch.cli import supervised
    from stack.launch.supervise import spawn, supervisor_running

    if supervised(launch) and not supervisor_running(run):  # one per run dir: restarts what dies
        print(f"supervisor: pid {spawn(run)} restarts a process of {run.path} that dies", file=sys.stderr)
    script = _SCRIPTS[args.role]
    extra = f" --node {args.node}" if args.node else ""
    print(
        f"{args.role}: {len(started)} process(es) ready; run dir {run.path}; "
        f"stop with: {script} stop --config {cfg.get('_source')}{extra}",
        file=sys.stderr,
    )
    print(
        json.dumps({"role": args.role, "run_dir": str(run.path), "processes": [m.to_json() for m in started]})
    )
    return 0


def _stop(cfg: dict[str, Any], specs: list[ProcessSpec], args) -> int:
    run = RunDir(Path(cfg["launch"].get("run_dir", ".smetric/run")))
    names = {s.name for s in specs}
    recs = [r for r in run.records() if r["name"] in names and r.get("role", args.role) == args.role]
    if not recs:
        print(f"{args.role}: nothing recorded under {run.path}")
        return 0
    res = stop_groups(recs, run, grace_s=args.grace)  # marked first: not restarted
    if not run.live_records():  # nothing left here to supervise
        from stack.launch.supervise import stop_supervisor

        stop_supervisor(run)
    gone = [r["name"] for r in recs if r["name"] not in res.stopped]
    print(
        f"{args.role}: stopped {len(res.stopped)} process(es)"
        + (f": {', '.join(res.stopped)}" if res.stopped else "")
        + (f" (SIGKILL: {', '.join(res.killed)})" if res.killed else "")
        + (f"; already gone: {', '.join(gone)}" if gone else "")
    )
    return 0


def _status(cfg: dict[str, Any], specs: list[ProcessSpec], args) -> int:
    from stack.launch.process import proc_alive

    run = RunDir(Path(cfg["launch"].get("run_dir", ".smetric/run")))
    recs = {r["name"]: r for r in run.records()}
    down = 0
    for s in specs:
        r = recs.get(s.name)
        alive = r is not None and proc_alive(int(r["pid"]), r.get("start_time"))
        down += not alive
        state = f"running pid {r['pid']}" if alive else "not running"
        if alive:
            state += ", ready" if probe(s, timeout=2.0) else ", not ready"
        print(f"{s.name} [{s.role}] node {s.node} ({s.host}): {state}")
    return 3 if down else 0


#: what each role's script starts (its --help)
_ABOUT = {
    "mooncake_master": "The Mooncake master (the global KV tier's metadata and HTTP metadata server).",
    "redis": "The Redis that router replicas share state through (when the deployment starts one).",
    "lmcache_server": "The LMCache server of this node (launch.kv_tier: lmcache): the daemon SGLang "
    "workers with --enable-lmcache dial (mp_host/mp_port), the Mooncake store behind it as its L2.",
    "lmcache_controller": "The LMCache controller (launch.kv_tier: lmcache): which instance holds a "
    "prefix, what the router asks (POST /lookup) for its global-tier view.",
    "prefill": "The prefill instances placed on this node.",
    "decode": "The decode instances placed on this node.",
    "router": "The SMetric router (every replica placed on this node), with its config file.",
}
_ACTIONS = """actions:
  start (default)  start them here, wait until ready, return; PID files and logs under
                   launch.run_dir (or --run-dir): pids/<name>.json, logs/<name>.log
  stop             stop exactly those processes (SIGTERM, SIGKILL after --grace seconds)
  status           running / ready, per process (exit 3 if one is not running)"""


def _parser(role: str | None) -> argparse.ArgumentParser:
    """The command line of one role's script (``role`` given: ``launch/<script>.sh``, the role
    fixed) or of the module itself (the role its first argument)."""
    ap = argparse.ArgumentParser(
        prog=_SCRIPTS[role] if role else "python -m stack.launch.role",
        description=_ABOUT[role] if role else "start, stop or show one role of a deployment on this node",
        epilog=_ACTIONS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if role is None:
        ap.add_argument("role", choices=[*ROLES, *_ALIASES])
    ap.add_argument("action", nargs="?", default="start", choices=["start", "stop", "status"])
    ap.add_argument("--config", default=None, help="deployment YAML (default: configs/local.yaml)")
    ap.add_argument(
        "--node",
        default=None,
        help="this node's name or host in launch.nodes (default: the node whose name or host is "
        "this machine's; needed when the role spans nodes and none matches)",
    )
    ap.add_argument("--run-dir", default=None, help="PID files and logs (default: launch.run_dir)")
    ap.add_argument(
        "--dry-run", action="store_true", help="print the exact commands and environment; start nothing"
    )
    ap.add_argument("--format", choices=["text", "json"], default="text", help="--dry-run output")
    ap.add_argument("--ready-timeout", type=float, default=None, help="seconds to wait for readiness")
    ap.add_argument("--grace", type=float, default=10.0, help="stop: seconds between SIGTERM and SIGKILL")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    role = _ALIASES.get(argv[0], argv[0]) if argv else None
    if role in ROLES:  # a role's script: its own usage, the role fixed
        ap = _parser(role)
        args = ap.parse_intermixed_args(argv[1:])
        args.role = role
    else:
        ap = _parser(None)
        args = ap.parse_intermixed_args(argv)
    args.role = _ALIASES.get(args.role, args.role)
    try:
        cfg, specs, rcfg, rpath = _select(args)
        if args.dry_run:
            if args.format == "json":
                print(json.dumps([dataclasses.asdict(s) for s in specs], indent=1))
            else:
                print(dry_run_text(cfg, specs, rcfg, rpath), end="")
            return 0
        if args.action == "stop":
            return _stop(cfg, specs, args)
        if args.action == "status":
            return _status(cfg, specs, args)
        return _start(cfg, specs, rcfg, rpath, args)
    except (ValueError, FileNotFoundError) as e:
        who = ap.prog if role in ROLES else f"{ap.prog} {args.role}"
        print(f"{who}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
