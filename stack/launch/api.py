"""Programmatic `smetric up --detach` / `smetric down`, for commands that drive a local stack
(e.g. a live replay comparing policies)::

    from stack.launch.api import local_stack

    with local_stack(prefill=4, decode=2, policy="smetric") as info:
        replay(info["router_url"], ...)

``up`` returns ``{"router_url", "router_urls", "run_dir", "prefill": [urls], "decode": [urls]}``
(``router_urls``: one per replica, ``router_replicas=N``; ``router_url`` is the first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from stack.launch import cli as up_cli
from stack.launch import cli_down


def up(
    config: str | Path | None = None,
    run_dir: str | Path | None = None,
    prefill: int | None = None,
    decode: int | None = None,
    policy: str | None = None,
    ports: str = "auto",
    router: bool = True,
    time_factor: float | None = None,
    ready_timeout: float | None = None,
    mooncake: bool = True,
    router_replicas: int | None = None,
) -> dict:
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="smetric-run-"))
    args = argparse.Namespace(
        config=str(config) if config else None,
        run_dir=str(run_dir),
        ports=ports,
        prefill=prefill,
        decode=decode,
        no_router=not router,
        policy=policy,
        time_factor=time_factor,
        detach=True,
        dry_run=False,
        k8s=None,
        ready_timeout=ready_timeout,
        no_mooncake=not mooncake,
        router_replicas=router_replicas,
    )
    rc = up_cli.run(args)
    if rc != 0:
        raise RuntimeError(f"smetric up failed (exit {rc}); logs in {run_dir / 'logs'}")
    state = json.loads((run_dir / "state.json").read_text())
    return {
        "router_url": state["router_url"],
        "router_urls": state.get("router_urls") or ([state["router_url"]] if state["router_url"] else []),
        "run_dir": str(run_dir),
        "prefill": state["prefill"],
        "decode": state["decode"],
    }


def down(run_dir: str | Path) -> int:
    return cli_down.run(argparse.Namespace(run_dir=str(run_dir), config=None, grace=10.0))


@contextlib.contextmanager
def local_stack(**kw) -> Iterator[dict]:
    info = up(**kw)
    try:
        yield info
    finally:
        down(info["run_dir"])
