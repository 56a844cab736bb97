"""``local_stack`` for replay runs and tests: ``stack.launch.api.local_stack`` with its
arguments taken from ``smetric up``'s own parser, so a new ``up`` flag never breaks it
(api.up builds its Namespace by hand and lagged behind cli.py's ``--k8s``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path


def up(
    config=None,
    run_dir=None,
    prefill: int | None = None,
    decode: int | None = None,
    policy: str | None = None,
    ports: str = "auto",
    time_factor: float | None = None,
    ready_timeout: float | None = None,
    mooncake: bool = True,
    router: bool = True,
    workers_per_process: int | None = None,
) -> dict:
    from stack.launch import cli as up_cli

    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="smetric-run-"))
    p = argparse.ArgumentParser()
    up_cli.add_arguments(p)
    args = p.parse_args([])
    for k, v in {
        "config": str(config) if config else None,
        "run_dir": str(run_dir),
        "ports": ports,
        "prefill": prefill,
        "decode": decode,
        "policy": policy,
        "time_factor": time_factor,
        "detach": True,
        "dry_run": False,
        "ready_timeout": ready_timeout,
        "no_mooncake": not mooncake,
        "no_router": not router,
        "workers_per_process": workers_per_process,
    }.items():
        setattr(args, k, v)
    from stack.launch.api import down

    try:
        rc = up_cli.run(args)
    except BaseException:
        down(run_dir)  # whatever did start
        raise
    if rc != 0:
        down(run_dir)
        raise RuntimeError(f"smetric up failed (exit {rc}); logs in {run_dir / 'logs'}")
    state = json.loads((run_dir / "state.json").read_text())
    return {
        "router_url": state["router_url"],
        "tokenizer": _tokenizer_of(state),
        "run_dir": str(run_dir),
        "prefill": state["prefill"],
        "decode": state["decode"],
    }


@contextlib.contextmanager
def local_stack(**kw) -> Iterator[dict]:
    from stack.launch.api import down

    info = None
    try:
        info = up(**kw)
        yield info
    finally:
        if info is not None:
            down(info["run_dir"])


def _tokenizer_of(state: dict) -> str | None:
    """The model dir the stack tokenizes with (the router config's ``model.path``: the tiny
    model in the run dir by default): what a replay against it passes as ``tokenizer``."""
    import yaml

    try:
        rcfg = yaml.safe_load(Path(state["router_config"]).read_text()) or {}
    except (KeyError, OSError, yaml.YAMLError):
        return None
    path = (rcfg.get("model") or {}).get("path")
    return str(path) if path and Path(path).is_dir() else None
