"""``smetric down``: stop exactly what ``smetric up`` started (PID files under the run dir)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from stack.launch.process import RunDir, stop_records


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="deployment YAML whose launch.run_dir to use (default: configs/local.yaml)",
    )
    p.add_argument("--run-dir", default=None, help="run dir of the stack (overrides --config)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")


def run_dir_from(args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    from stack.launch.cli import default_config

    path = Path(args.config) if args.config else default_config()
    launch = {}
    if path.exists():
        launch = (yaml.safe_load(path.read_text()) or {}).get("launch") or {}
    return Path(launch.get("run_dir", ".smetric/run"))


def run(args: argparse.Namespace) -> int:
    from stack.launch.supervise import stop_supervisor

    run = RunDir(run_dir_from(args))
    if stop_supervisor(run):  # first: it would restart what is stopped below
        print("smetric down: stopped the supervisor")
    recs = run.records()
    if not recs:
        print(f"smetric down: nothing recorded under {run.path}")
        return 0
    names = stop_records(recs, run, grace_s=args.grace)
    gone = [r["name"] for r in recs if r["name"] not in names]
    print(
        f"smetric down: stopped {len(names)} process(es)"
        + (f": {', '.join(names)}" if names else "")
        + (f"; already gone: {', '.join(gone)}" if gone else "")
    )
    state = run.path / "state.json"
    if state.exists():
        state.unlink()
    return 0
