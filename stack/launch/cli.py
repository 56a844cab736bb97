"""``smetric up``: bring up a local PD stack (mooncake_master, prefill/decode workers, router).

``launch.router.replicas: N`` / ``--router-replicas N``: N routers (replica i on router.port + i)
in front of the pool, sharing state through one Redis (stack/launch/replicas.py).

Default config: ``configs/local.yaml`` (emulated workers). ``launch.engine: sglang`` starts real
SGLang workers from the same code path (commands built by ``stack.launch.sglang``), on this
machine only; ``--dry-run`` prints every command instead.

Foreground by default: shows startup progress and health, then waits; Ctrl-C (SIGINT, also
when the launcher was started with SIGINT ignored, as background jobs of a script are), SIGTERM
or SIGHUP stops everything it started: SIGTERM to each process group, SIGKILL after
``launch.stop_grace_s`` (10 s) for what did not stop, said on stderr; a second Ctrl-C kills
the leftovers at once. Output goes through :class:`~stack.launch.output.NeverBlockingWriter`,
so a full stdout/stderr pipe can delay a message but never the shutdown.
``--detach`` returns once everything is healthy; ``smetric down`` then stops exactly those
processes (PID files under the run dir).

``--prometheus`` (or ``launch.prometheus``): a real Prometheus beside the stack, scraping the
router(s) and every worker (:mod:`stack.launch.prometheus`), for the Grafana dashboard in
deploy/grafana/ (docs/operate/monitoring.md, "Dashboard").
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from stack.launch import emulated, replicas
from stack.launch.output import NeverBlockingWriter
from stack.launch.process import Managed, RunDir, probe, start, stop_groups, tail
from stack.launch.spec import ProcessSpec, ready_timeout_s
from stack.paths import configs_dir
from stack.ports import port_free

PHASES = (
    ("mooncake_master", "redis", "metadata"),
    ("lmcache_controller",),  # kv_tier lmcache: its engines report to the controller
    ("lmcache_server",),
    ("prefill", "decode"),
    ("router",),
    ("prometheus",),  # --prometheus: scrapes the router(s) and the workers
)


def default_config() -> Path:
    return configs_dir() / "local.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="deployment YAML (default: configs/local.yaml)")
    p.add_argument("--run-dir", default=None, help="PID files, logs, router config (default: launch.run_dir)")
    p.add_argument(
        "--ports",
        choices=["fixed", "auto"],
        default=None,
        help="fixed: the config's ports; auto: free ports picked now (default: launch.ports)",
    )
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="number of prefill workers")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="number of decode workers")
    p.add_argument(
        "--workers-per-process",
        type=int,
        default=None,
        metavar="K",
        help="emulated workers sharing one process and event loop, per role (each still its own "
        "endpoint, KV events, Mooncake clients; default: launch.<role>.workers_per_process, 1)",
    )
    p.add_argument("--no-router", action="store_true", help="start the workers (and master) only")
    p.add_argument(
        "--router-replicas",
        type=int,
        default=None,
        metavar="N",
        help="N router replicas on router.port + i sharing one Redis (started unless launch.redis "
        "or router.redis_url says otherwise; default: launch.router.replicas, 1)",
    )
    p.add_argument("--policy", default=None, help="router policy (overrides router.policy)")
    p.add_argument(
        "--no-mooncake",
        action="store_true",
        help="no mooncake_master: no global tier, PD hand-off over HTTP when Mooncake is absent",
    )
    p.add_argument(
        "--time-factor", type=float, default=None, help="emulator: real seconds per modelled second"
    )
    p.add_argument("--detach", action="store_true", help="return once healthy (stop later with smetric down)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print every command with its environment, per node; start nothing",
    )
    p.add_argument(
        "--k8s",
        default=None,
        metavar="OUTDIR",
        help="render Kubernetes manifests for the config into OUTDIR; start nothing",
    )
    p.add_argument("--ready-timeout", type=float, default=None, help="seconds to wait for each phase")
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="also start Prometheus (Debian's `prometheus`) scraping the router(s) and every worker, on "
        "launch.prometheus.port (9090; a free port with --ports auto), every "
        "launch.prometheus.scrape_interval_s (5 s); config and data under the run dir. The Grafana "
        "dashboard deploy/grafana/stack-dashboard.json reads it",
    )


def load(args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.config) if args.config else default_config()
    if not path.exists():
        raise FileNotFoundError(f"config not found: {path}")
    cfg = yaml.safe_load(path.read_text()) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    launch = cfg.setdefault("launch", {}) or {}
    cfg["launch"] = launch
    if args.run_dir:
        launch["run_dir"] = args.run_dir
    if args.ports:
        launch["ports"] = args.ports
    for role, n in (("prefill", args.prefill), ("decode", args.decode)):
        if n is not None:
            launch[role] = {**(launch.get(role) or {}), "count": n}
    k = getattr(args, "workers_per_process", None)
    if k is not None:
        if k < 1:
            raise ValueError(f"--workers-per-process: must be >= 1 (got {k})")
        for role in ("prefill", "decode"):
            launch[role] = {**(launch.get(role) or {}), "workers_per_process": k}
    if args.no_router:
        launch["router"] = {**(launch.get("router") or {}), "enabled": False}
    n = getattr(args, "router_replicas", None)
    if n is not None:
        if n < 1:
            raise ValueError(f"--router-replicas: must be >= 1 (got {n})")
        r = launch.get("router")
        launch["router"] = {**(r if isinstance(r, dict) else {}), "replicas": n}
        if r is False:
            launch["router"]["enabled"] = False
        ports = launch["router"].get("ports")
        if ports is not None and len(ports) != n:
            launch["router"].pop("ports")  # the flag wins over a ports list of another length
    if getattr(args, "no_mooncake", False):
        launch["mooncake_master"] = None
    if getattr(args, "policy", None):
        cfg["router"] = {**(cfg.get("router") or {}), "policy": args.policy}
    if args.time_factor is not None:
        launch["emulator"] = {**(launch.get("emulator") or {}), "time_factor": args.time_factor}
    if getattr(args, "prometheus", False):
        pc = launch.get("prometheus")
        launch["prometheus"] = {**(pc if isinstance(pc, dict) else {}), "enabled": True}
    replicas.ensure_redis(cfg)  # several replicas: a shared Redis (started, or router.redis_url)
    cfg["_source"] = str(path)
    return cfg


def build(cfg: dict[str, Any], dry_run: bool = False) -> tuple[list[ProcessSpec], dict[str, Any], Path, str]:
    """(specs, router config, router config path, router URL) for this config."""
    launch = cfg["launch"]
    src = cfg.pop("_source", None)
    engine = str(launch.get("engine", "emulate"))
    if engine == "sglang":
        try:
            from stack.launch import sglang
        except ImportError as e:
            raise ValueError(f"launch.engine: sglang needs stack.launch.sglang ({e})") from None
        specs = sglang.sglang_process_specs(cfg)
        for s in specs:
            if not dry_run and s.host not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError(
                    f"{s.name} runs on {s.host}: `smetric up` starts local processes only; "
                    "use --dry-run for per-node commands"
                )
        rcfg = sglang.resolved_config(cfg)
        rpath = Path(sglang.router_config_path(cfg))
    elif engine in ("emulate", "emulated"):
        model = cfg.setdefault("model", {}) or {}
        cfg["model"] = model
        if not model.get("path") and str(launch.get("tokenizer", "")) == "tiny":
            # router and emulated workers must tokenize alike: a tiny local tokenizer, no hub
            tiny = Path(launch.get("run_dir", ".smetric/run")).resolve() / "tiny-model"
            if not (tiny / "tokenizer.json").exists() and not dry_run:
                from stack.models.tiny import build_tiny_model

                build_tiny_model(tiny)
            model["path"] = str(tiny)
        plan = emulated.plan(cfg)
        launch["_plan"] = plan
        busy = [
            f"{what}={port}" for what, port in emulated.all_ports(plan) if not port_free(plan["host"], port)
        ]
        if busy:
            launch["_busy"] = busy
        rcfg = emulated.resolved_config(
            {k: v for k, v in cfg.items() if k != "launch"}
            | {"launch": {k: v for k, v in launch.items() if not k.startswith("_")}},
            plan,
        )
        rpath = emulated.router_config_path(cfg)
        specs = emulated.process_specs(cfg, plan, rpath.resolve())
    else:
        raise ValueError(f"launch.engine must be emulate or sglang, not {engine!r}")
    if not dry_run:  # a Redis beyond loopback: its password (generated once, kept in the run dir)
        replicas.provide_password(launch, specs)
    router = rcfg.get("router") or {}
    url = f"http://{router.get('host', '127.0.0.1')}:{router.get('port', 8000)}"
    pc = launch.get("prometheus")
    if pc and (not isinstance(pc, dict) or pc.get("enabled", True)):
        from stack.launch.prometheus import stack_spec

        router_urls = [
            s.ready_url.rsplit("/health", 1)[0] for s in specs if s.role == "router" and s.ready_url
        ]
        host = str(launch.get("bind_host", "127.0.0.1"))
        spec = stack_spec(launch, rcfg, router_urls, host, specs)
        specs.append(spec)
        if not dry_run and not port_free(host, spec.ready_port):
            launch["_busy"] = [*launch.get("_busy", []), f"prometheus={spec.ready_port}"]
    if src:
        cfg["_source"] = src
    return specs, rcfg, rpath, url


def emulated_spec_text(s: ProcessSpec) -> str:
    """One emulated-stack process as ``smetric up --dry-run`` prints it."""
    import shlex

    env = " ".join(f"{k}={v}" for k, v in s.env.items())
    return f"# {s.name} [{s.role}]\n{env} {shlex.join(s.argv)} &"


def router_config_text(rcfg: dict[str, Any], rpath: Path) -> str:
    """The router config of an emulated stack as ``smetric up --dry-run`` prints it."""
    return f"# router config -> {rpath}\n" + yaml.safe_dump(rcfg, sort_keys=False).rstrip()


#: what to do when a role's program is not on PATH
_INSTALL_HINTS = {
    "mooncake_master": " (pip install mooncake-transfer-engine-non-cuda, see .ci/install-system.sh; or set "
    "launch.mooncake_master: null to run without a global tier)",
    "redis": " (apt install redis-server, see .ci/install-system.sh; or point router.redis_url "
    "at a running Redis)",
    "prometheus": " (apt install prometheus, see .ci/install-system.sh; or drop --prometheus)",
    "lmcache_server": " (LMCache lives in its own environment: bash .ci/install-lmcache.sh, then set "
    "launch.lmcache.command / controller_command to its scripts)",
}
_INSTALL_HINTS["lmcache_controller"] = _INSTALL_HINTS["lmcache_server"]


def check_commands(specs: list[ProcessSpec]) -> None:
    """Refuse (FileNotFoundError, with an install hint) a spec whose program is not on PATH."""
    import shutil

    for s in specs:
        if shutil.which(s.argv[0]) is None:
            hint = _INSTALL_HINTS.get(s.role, "")
            raise FileNotFoundError(f"{s.name}: command not found: {s.argv[0]}{hint}")


def write_router_config(rcfg: dict[str, Any], rpath: Path) -> None:
    """Write the router's config file (what every router spec's ``--config`` names), validated."""
    body = {k: v for k, v in rcfg.items() if not k.startswith("_")}
    rpath.parent.mkdir(parents=True, exist_ok=True)
    rpath.write_text(yaml.safe_dump(body, sort_keys=False))
    try:  # validate against the router's schema when it is there
        from stack.config import parse_config

        parse_config(body, source=str(rpath))
    except ImportError:
        pass


def _table(managed: list[Managed], specs: list[ProcessSpec], started: dict[str, Managed]):
    from rich.table import Table

    t = Table(title="smetric up", show_lines=False)
    for col in ("process", "role", "address", "pid", "status", "s"):
        t.add_column(col)
    for s in specs:
        m = started.get(s.name)
        addr = (
            s.ready_url.rsplit("/", 1)[0]
            if s.ready_url
            else (f"{s.host}:{s.ready_port}" if s.ready_port else "-")
        )
        if m is None:
            t.add_row(s.name, s.role, addr, "-", "[dim]pending[/]", "")
            continue
        color = {"ready": "green", "failed": "red", "starting": "yellow"}.get(m.status, "white")
        el = (m.ready_at or time.monotonic()) - m.started_at
        t.add_row(s.name, s.role, addr, str(m.pid), f"[{color}]{m.status}[/]", f"{el:.1f}")
    return t


class _Stop(Exception):
    """Raised in the main thread by the first stop signal."""


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopSignals:
    """The launcher's own handlers for SIGINT, SIGTERM and SIGHUP while it runs a stack.

    Installed explicitly for SIGINT too: a process started with SIGINT ignored (a background
    job of a shell script, a supervisor) inherits that, and Python then never raises
    KeyboardInterrupt, so Ctrl-C would do nothing. The first signal raises :class:`_Stop`
    (unless shutdown already began); any later one only sets :attr:`hurry`, which the
    shutdown polls to SIGKILL the leftovers at once instead of waiting out the grace period.
    """

    def __init__(self) -> None:
        self.count = 0
        self.stopping = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> _StopSignals:
        self._old = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        if not self.stopping:
            self.stopping = True
            raise _Stop(signum)

    def hurry(self) -> bool:
        return self.count >= 2


def _shutdown(run_dir: RunDir, order: list[Managed], grace: float, signals: _StopSignals, console) -> None:
    """Stop everything started (Ctrl-C, failure, or foreground exit), bounded in time."""
    res = stop_groups(run_dir.records(), run_dir, grace_s=grace, hurry=signals.hurry)
    for m in order:  # reap them (already dead: SIGTERM'd or SIGKILLed above)
        if m.popen is not None:
            try:
                m.popen.wait(timeout=1)
            except Exception:  # noqa: BLE001 - a process in D state must not hold us
                pass
    if res.killed:
        why = "a second Ctrl-C" if signals.hurry() else f"no exit {grace:g} s after SIGTERM"
        console.print(f"[yellow]killed (SIGKILL, {why})[/]: {', '.join(res.killed)}")
    if res.stopped:
        console.print(f"stopped: {', '.join(res.stopped)}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = NeverBlockingWriter(2)
    out = NeverBlockingWriter(1)
    console = Console(file=err)
    cfg = load(args)
    if args.k8s:
        from stack.launch.k8s import summary, write_k8s

        print(summary(write_k8s({k: v for k, v in cfg.items() if k != "_source"}, args.k8s)))
        return 0
    specs, rcfg, rpath, router_url = build(cfg, dry_run=args.dry_run)
    launch = cfg["launch"]
    run_dir = RunDir(Path(launch.get("run_dir", ".smetric/run")))
    if args.dry_run:
        _print_dry_run(cfg, specs, rcfg, rpath)
        return 0
    _prepare(specs, launch, run_dir, rcfg, rpath)

    timeout = ready_timeout_s(launch, args.ready_timeout)
    started: dict[str, Managed] = {}
    order: list[Managed] = []

    grace = float(launch.get("stop_grace_s", 10.0))
    signals = _StopSignals().__enter__()
    ok = False
    try:
        _start_phases(specs, run_dir, timeout, started, order, console)
        if not console.is_terminal:
            console.print(_table(order, specs, started))
        _announce(cfg, specs, rcfg, rpath, router_url, run_dir, order, console, out)
        ok = True
        supervise = supervised(launch)
        if args.detach:
            if supervise:  # a process of its own restarts what dies (stack.launch.supervise)
                from stack.launch.supervise import spawn

                console.print(f"supervisor: pid {spawn(run_dir)} restarts a process that dies")
            console.print(f"stop it with: smetric down --run-dir {run_dir.path}")
            for m in order:  # leave them running; don't reap
                m.popen = None
            return 0
        return _watch(order, console, run_dir if supervise else None)
    except (KeyboardInterrupt, _Stop):
        signals.stopping = True
        console.print(f"stopping (SIGTERM, SIGKILL after {grace:g} s; Ctrl-C again to kill now) ...")
        ok = True
        return 0 if not started or all(m.status == "ready" for m in order) else 130
    except RuntimeError as e:
        signals.stopping = True
        console.print(f"[red]startup failed[/]: {e}")
        return 1
    finally:
        signals.stopping = True  # from here on a signal only hurries the shutdown
        if not (ok and args.detach):
            _shutdown(run_dir, order, grace, signals, console)
        signals.__exit__()


def _print_dry_run(cfg: dict[str, Any], specs: list[ProcessSpec], rcfg: dict[str, Any], rpath: Path) -> None:
    """``--dry-run``: every command (and the router config) that ``smetric up`` would start."""
    engine = str(cfg["launch"].get("engine", "emulate"))
    if engine == "sglang":
        from stack.launch import sglang

        print(sglang.dry_run_text({k: v for k, v in cfg.items() if k != "_source"}))
    else:
        print(router_config_text(rcfg, rpath))
        for s in specs:
            print(emulated_spec_text(s))


def _prepare(
    specs: list[ProcessSpec], launch: dict[str, Any], run_dir: RunDir, rcfg: dict[str, Any], rpath: Path
) -> None:
    """Before anything starts: the commands exist, the ports are free, no stack of this run dir
    is still running; then a clean run dir and the router config written."""
    check_commands(specs)
    if launch.get("_busy"):
        raise ValueError(
            "ports in use: "
            + ", ".join(launch["_busy"])
            + " (another stack running? `smetric down`, or pass --ports auto)"
        )
    from stack.launch.supervise import supervisor_running

    live = run_dir.live_records()
    if supervisor_running(run_dir):
        live.append({"name": "supervisor"})
    if live:
        raise ValueError(
            f"a stack started from {run_dir.path} is still running ({', '.join(r['name'] for r in live)}): "
            f"`smetric down --run-dir {run_dir.path}` first"
        )
    run_dir.ensure()
    for stale in run_dir.records():
        run_dir.remove(stale["name"])
    write_router_config(rcfg, rpath)


def _start_phases(
    specs: list[ProcessSpec],
    run_dir: RunDir,
    timeout: float,
    started: dict[str, Managed],
    order: list[Managed],
    console,
) -> None:
    """Start the processes phase by phase (PHASES), each phase ready before the next, with a
    live table; ``started`` and ``order`` fill as they start (the caller stops them)."""
    from rich.live import Live

    with Live(
        _table(order, specs, started),
        console=console,
        refresh_per_second=4,
        transient=not console.is_terminal,
    ) as view:
        seq = 0
        for roles in PHASES:
            phase = [s for s in specs if s.role in roles]
            for s in phase:
                # a stop signal between fork and the PID file would orphan the child
                signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
                try:
                    m = start(s, run_dir, seq)
                    started[s.name] = m
                    order.append(m)
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
                seq += 1
            _wait_ready(
                [started[s.name] for s in phase],
                timeout,
                run_dir,
                lambda: view.update(_table(order, specs, started)),
            )
        view.update(_table(order, specs, started))


def _wait_ready(pending: list[Managed], timeout: float, run_dir: RunDir, refresh) -> None:
    """Until every process of one phase answers its probe; RuntimeError when one exits or
    ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while pending:
        for m in list(pending):
            if not m.alive():
                m.status = "failed"
                raise RuntimeError(f"{m.spec.name} exited during startup (log {m.log}):\n{tail(m.log)}")
            if probe(m.spec, timeout=5.0):
                m.status, m.ready_at = "ready", time.monotonic()
                pending.remove(m)
        refresh()
        if pending and time.monotonic() > deadline:
            for m in pending:
                m.status = "failed"
            refresh()
            names = ", ".join(m.spec.name for m in pending)
            raise RuntimeError(
                f"not ready after {timeout:.0f} s: {names} (logs in {run_dir.logs}):\n" + tail(pending[0].log)
            )
        if pending:
            time.sleep(0.2)


def _announce(
    cfg: dict[str, Any],
    specs: list[ProcessSpec],
    rcfg: dict[str, Any],
    rpath: Path,
    router_url: str,
    run_dir: RunDir,
    order: list[Managed],
    console,
    out,
) -> None:
    """The stack is up: state.json in the run dir, a line on the console, the JSON line on stdout."""
    router_urls = [s.ready_url.rsplit("/health", 1)[0] for s in specs if s.role == "router"]
    state = {
        "started": time.time(),
        "config": cfg.get("_source"),
        "engine": cfg["launch"].get("engine", "emulate"),
        "router_url": router_url if router_urls else None,
        "router_urls": router_urls,  # one per replica; router_url is the first
        "redis_url": (rcfg.get("router") or {}).get("redis_url"),
        "router_config": str(rpath),
        "processes": [m.to_json() for m in order],
        "prefill": [w["url"] for w in rcfg.get("prefill", [])],
        "decode": [w["url"] for w in rcfg.get("decode", [])],
        "prometheus_url": next(
            (s.ready_url.rsplit("/-/ready", 1)[0] for s in specs if s.role == "prometheus"), None
        ),
    }
    (run_dir.path / "state.json").write_text(json.dumps(state, indent=1))
    n_p = len(state["prefill"])
    n_d = len(state["decode"])
    where = state["router_url"] or "(no router)"
    if len(router_urls) > 1:
        where = f"{len(router_urls)} replicas {', '.join(router_urls)} (Redis {state['redis_url']})"
    if state["prometheus_url"]:
        where += f"; Prometheus {state['prometheus_url']}"
    console.print(
        f"[green]stack up[/]: {n_p} prefill + {n_d} decode workers, router {where}; run dir {run_dir.path}"
    )
    print(
        json.dumps(
            {
                "router_url": state["router_url"],
                "router_urls": state["router_urls"],
                "run_dir": str(run_dir.path),
                "prefill": state["prefill"],
                "decode": state["decode"],
                "prometheus_url": state["prometheus_url"],
            }
        ),
        file=out,
    )


def supervised(launch: dict[str, Any]) -> bool:
    """``launch.supervise`` (default true): restart a process that dies (stack.launch.supervise)."""
    v = launch.get("supervise", True)
    if not isinstance(v, bool):
        raise ValueError(f"launch.supervise: true or false (got {v!r})")
    return v


def _watch(order: list[Managed], console, run_dir: RunDir | None = None) -> int:
    """Foreground: report each process that exits; with ``run_dir``, restart it (the
    supervisor, in this process: stack.launch.supervise); return when all are gone."""
    console.print("Ctrl-C stops the stack.")
    reported: set[str] = set()
    sup = None
    if run_dir is not None:
        from stack.launch.supervise import Supervisor

        sup = Supervisor(run_dir, say=lambda text: console.print(f"[yellow]{text}[/]"))
    while True:
        time.sleep(1.0)
        if sup is not None:
            for name in sup.check():
                reported.discard(name)
                for m in order:  # follow the new process
                    if m.spec.name == name:
                        rec = run_dir.record(name)
                        m.pid, m.pgid, m.start_time, m.popen = (
                            rec["pid"],
                            rec["pgid"],
                            rec.get("start_time"),
                            None,
                        )
        gone = [m for m in order if not m.alive()]
        for m in gone:
            if m.spec.name not in reported:
                reported.add(m.spec.name)
                console.print(f"[red]{m.spec.name} exited[/] (log {m.log})")
        if len(gone) == len(order):
            console.print("every process is gone (smetric down?)")
            return 0
