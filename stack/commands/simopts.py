"""Command-line options shared by `smetric sim`, `smetric bench`, `smetric demo` and
`smetric replay`.

This module only declares the arguments; what they mean, their validation and the
resolution of ``--load-mode auto`` live in :class:`stack.sim.options.SimOptions`, which
every command builds from its parsed arguments.
"""

from __future__ import annotations

import argparse

from stack.paths import default_trace
from stack.policies import POLICIES
from stack.sim.engine import SimConfig
from stack.sim.load import LOAD_MODES
from stack.sim.options import SimOptions, parse_params


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--instances", type=int, default=32, help="number of prefill instances")
    g.add_argument(
        "--hardware", default="h20", help="calibration: h20, h200 or a YAML file (configs/hardware/)"
    )
    g.add_argument(
        "--hbm-tokens",
        type=int,
        default=None,
        help="local KV room per instance in tokens (default: from the calibration)",
    )
    g.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="chunked-prefill token budget per forward (default: from the calibration)",
    )
    g.add_argument(
        "--global-tier",
        default="full",
        help="global KV tier: none, full (unbounded) or a capacity: tokens (2M) or bytes (256GB)",
    )
    g.add_argument(
        "--link",
        choices=["per-gpu", "shared"],
        default="per-gpu",
        help="global-tier link: one 200 Gbps NIC per GPU, or one per server shared by its GPUs",
    )
    g.add_argument(
        "--match-at",
        choices=["arrival", "schedule"],
        default="arrival",
        help="when an instance matches its local prefix cache: at arrival (the hit the router saw) "
        "or when the request first enters a prefill batch, locking the match until it completes (SGLang)",
    )
    g.add_argument(
        "--global-write",
        choices=["instant", "link"],
        default="instant",
        help="a finished prefill's KV reaches the global tier at once, or after its write over the "
        "instance's link (queued with fetches)",
    )
    g.add_argument("--slo-b", type=float, default=1.0, help="TTFT SLO fixed budget b in seconds")
    g.add_argument(
        "--slo-a",
        type=float,
        default=0.0625,
        help="TTFT SLO per-token budget a in seconds per 1k prompt tokens",
    )
    g.add_argument(
        "--slo-tpot",
        type=float,
        default=0.020,
        help="TPOT SLO in seconds per output token (colocated mode; the paper's 20 ms for the 30B model)",
    )
    g.add_argument(
        "--mode",
        choices=["pd", "colocated"],
        default="pd",
        help="pd: prefill instances only (decode in another pool); colocated: each instance "
        "also decodes its requests in the same forwards (SGLang chunked prefill, mixed batches)",
    )
    g.add_argument(
        "--decode-steps",
        choices=["aggregate", "step"],
        default="aggregate",
        help="colocated: advance decodes over intervals of equal batch composition (aggregate) "
        "or one event per forward (step, the slow reference)",
    )
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy parameter, repeatable (smetric: slack=1.5, hit_ratio=0.8; linear: lam=0.9)",
    )


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """The client model (stack/sim/clients.py): clients that time out and retry."""
    g = p.add_argument_group("clients")
    g.add_argument(
        "--clients",
        action="store_true",
        help="model clients that time out and retry (the OpenAI and Anthropic SDKs' retries on "
        "overload answers and timeouts, Retry-After honoured, the SDKs' read timeout or a "
        "load balancer's idle timeout); TTFT then counts from a request's first attempt (default: off, every client "
        "waits however long and a refused request is not retried)",
    )
    g.add_argument(
        "--client-patience",
        type=float,
        default=600.0,
        help="--clients: seconds without a first token before a client gives up on an attempt "
        "(default: the SDKs' read timeout; a load balancer in front bounds it by its idle "
        "timeout, commonly 60 s)",
    )
    g.add_argument(
        "--client-retries",
        type=int,
        default=2,
        help="--clients: retries after the first attempt (the SDKs' 2)",
    )


def add_dispatch_arguments(p: argparse.ArgumentParser, axis: bool = False) -> None:
    """``--dispatch`` (one order; ``axis``: a comma-separated list, the bench's axis) and
    ``--dispatch-param``."""
    from stack.dispatch import ORDERS, ROUTER_DISPATCH, SIM_DISPATCH
    from stack.dispatch.spec import key_help

    g = p.add_argument_group("dispatch")
    if axis:
        g.add_argument(
            "--dispatch",
            dest="dispatches",
            default=SIM_DISPATCH.label(),
            help="comma-separated dispatch orders, each optionally with its own parameters "
            f"(name:key=value:...), an axis beside --policies: {', '.join(ORDERS)}",
        )
    else:
        g.add_argument(
            "--dispatch",
            default=SIM_DISPATCH.order,
            choices=list(ORDERS),
            help="when and in which order requests leave the router: immediate (route at "
            "arrival, no queue), fifo (late binding), deadline (EDF), deadline-defer (EDF, "
            "hopeless requests after feasible ones, aged back in after age_k x SLO), slack "
            "(deadline-defer that serves a deferred request early when the most urgent "
            "feasible one has slack to absorb it), laxity (least laxity first, hopeless "
            "requests re-keyed to relax_k x SLO)",
        )
    g.add_argument(
        "--dispatch-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dispatch parameter, repeatable (the simulator's defaults; the router's: "
        f"{ROUTER_DISPATCH.label()}): {key_help()}; and the order's own: age_k "
        "(deadline-defer, default 5; slack, default 3; the router's 1.5), steal (slack, default 1), "
        "aged_share (deadline-defer, default 1; slack, 0.25; the router, 0.125), far_k (deadline-defer "
        "and slack: late requests that can still stay under far_k x SLO go first; default 0: off; "
        "the router's 5), "
        "relax_k (laxity, default 2)",
    )


def add_load_arguments(p: argparse.ArgumentParser, rate: bool = True) -> None:
    g = p.add_argument_group("load")
    g.add_argument(
        "--trace",
        default=str(default_trace()),
        help="trace file (agentic or Mooncake JSONL, .gz ok); default: the shipped slice",
    )
    g.add_argument("--format", default="auto", choices=["auto", "agentic", "mooncake"], help="trace format")
    g.add_argument(
        "--shared-prefix",
        action="store_true",
        help="agentic traces: share each request's tools + system-prompt blocks across sessions (optimistic)",
    )
    g.add_argument(
        "--load-mode",
        default="auto",
        choices=list(LOAD_MODES),
        help="sessions: seeded Poisson session starts replaying whole sessions (stationary); "
        "compress: the trace's own clock divided by --rate-scale (auto: compress for traces with a "
        "real global clock, sessions otherwise). Follow-ups always wait for their predecessor's answer",
    )
    if rate:
        g.add_argument(
            "--rate-scale",
            type=float,
            default=1.0,
            help="load as a multiple of the trace's base session rate (compress: time compression)",
        )
        g.add_argument(
            "--session-rate",
            type=float,
            default=None,
            help="session starts per second (overrides --rate-scale; sessions mode)",
        )
    g.add_argument(
        "--duration", type=float, default=28800.0, help="seconds of session arrivals (sessions mode)"
    )
    g.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from metrics (default: 5/8 of the duration, i.e. 5 h of 8; compress: a tenth of the span)",
    )
    g.add_argument(
        "--max-think",
        type=float,
        default=None,
        help="cap agent think times at this many seconds (default: as recorded)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the session arrival process")
    g.add_argument(
        "--perturb",
        type=int,
        default=None,
        metavar="SEED",
        help="the same load perturbed by SEED: session starts move by up to 1 ms, think times by up "
        "to 1%% (the chaos floor, docs/research/fidelity.md; default: as recorded)",
    )


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return name


def sim_config(args: argparse.Namespace, policy_params: dict | None = None) -> SimConfig:
    """The validated cluster configuration of a parsed command line (see :class:`SimOptions`)."""
    return SimOptions.from_args(args).sim_config(policy_params)


__all__ = [
    "SimOptions",
    "add_cluster_arguments",
    "add_dispatch_arguments",
    "add_load_arguments",
    "check_policy",
    "parse_params",
    "sim_config",
]
