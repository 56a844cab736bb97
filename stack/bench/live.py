"""Live runs on a local emulated PD pool beside their simulated twins: the pieces
``smetric compare`` and ``smetric demo-live`` share (the session-load window options, the
replay config of a started pool, the simulator run with the same trace, load and instance
count, and the cell format of their tables)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stack.sim.load import LoadSpec

if TYPE_CHECKING:
    from stack.replay.driver import ReplayConfig


def session_load(args: argparse.Namespace) -> LoadSpec:
    """Stationary sessions-mode load from ``--session-rate/--duration/--warmup/--seed/--max-think``
    (the live commands: demo-live, compare, benchmarks/replicas.py)."""
    return LoadSpec(
        mode="sessions",
        session_rate=args.session_rate,
        duration=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        max_think=args.max_think,
    )


def add_window_arguments(p: argparse.ArgumentParser) -> None:
    """``--duration``, ``--warmup``, ``--max-think`` and ``--seed`` of the session load."""
    p.add_argument("--duration", type=float, default=600.0, help="modelled seconds of session arrivals")
    p.add_argument("--warmup", type=float, default=100.0, help="modelled seconds excluded from the metrics")
    p.add_argument("--max-think", type=float, default=30.0, help="cap on think times (modelled s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the session arrivals (0: the first of every band; docs/research/fidelity.md)",
    )


def pool_replay_config(
    args: argparse.Namespace, info: dict, target: str, request_timeout: float, **extra: Any
) -> tuple[ReplayConfig, dict]:
    """The replay of ``args.trace`` with the session load of ``args`` against ``target``, at the
    time factor the pool's emulator runs (its first prefill worker's /server_info, else
    ``args.time_factor``), with the pool's tokenizer when it is a local directory; and the
    emulator's settings (capacity_tokens, hardware, ...)."""
    import httpx

    from stack.replay.driver import ReplayConfig

    si = httpx.get(info["prefill"][0] + "/server_info", timeout=10).json()
    emu = si.get("emulator") or {}
    tok = si.get("tokenizer_path")
    cfg = ReplayConfig(
        target=target,
        trace=args.trace,
        load=session_load(args),
        time_factor=float(emu.get("time_factor") or args.time_factor),
        request_timeout=request_timeout,
        tokenizer=tok if tok and Path(tok).is_dir() else None,
        **extra,
    )
    return cfg, emu


def simulate_pool(
    args: argparse.Namespace,
    trace,
    policy: str,
    hardware: str,
    hbm: int | None,
    perturb: int | None = None,
    **config: Any,
) -> dict:
    """The simulator's metrics for ``policy`` on ``args.prefill`` instances of ``hardware``
    with ``hbm`` tokens of KV room each, the global tier unless ``args.no_mooncake``, under the
    session load of ``args`` (``perturb``: that load perturbed, :attr:`LoadSpec.perturb`);
    ``config``: further SimConfig fields (dispatch, policy_params). With ``args.shared_nic``
    the instances share one link (``--link shared``), as the live stack's workers then do."""
    from stack.core.cost_model import load_hardware
    from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator

    hw = load_hardware(hardware)
    shared = bool(getattr(args, "shared_nic", False))
    if shared and args.prefill > hw.gpus_per_server:
        raise ValueError(
            f"--shared-nic: at most {hw.gpus_per_server} prefill workers share one NIC on {hw.name}"
        )
    cfg = SimConfig(
        instances=args.prefill,
        hardware=hw,
        global_tier=GlobalTierSpec("none" if args.no_mooncake else "full"),
        hbm_tokens=hbm,
        link="shared" if shared else "per-gpu",
        **config,
    )
    load = session_load(args)
    if perturb is not None:
        load = dataclasses.replace(load, perturb=perturb)
    return Simulator(trace, policy, cfg, load).run().metrics


def fmt_cell(v, f: str) -> str:
    """``v`` formatted with ``f`` for a table cell: '-' for None, str(v) where ``f`` does not apply."""
    if v is None:
        return "-"
    try:
        return f.format(v)
    except (ValueError, TypeError):
        return str(v)
