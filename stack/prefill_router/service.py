"""The OpenAI-compatible SMetric router (FastAPI on uvicorn): ``smetric router``.

Per request: parse (orjson), derive features (tokens, block hashes, turn, est_hit), fill
a :class:`ClusterView` (queued work, running, local hit per prefill worker; global hit),
ask the configured policy to ``choose``, pick the decode worker, and drive SGLang's PD
hand-off (``stack.decode_router.handoff``). A failure before anything was streamed is retried
once on another prefill worker; the failing worker is ejected until its health check
passes again.

Endpoints: the inference endpoints of :mod:`stack.prefill_router.api.endpoints`
(``/v1/chat/completions``, ``/v1/completions``, ``/generate``, ``/v1/embeddings``, the agent
APIs), ``/v1/models``, ``/health``, ``/metrics``, and the admin API ``/admin/workers`` (bearer token read from
the env var named by ``router.admin_token_env``).

This module is the command (arguments, config, uvicorn). The parts live in:
:mod:`stack.prefill_router.api` (the HTTP layer: app wiring, endpoints, parsing, the
request path, errors, admin, status), :mod:`stack.prefill_router.routing` (choose and book a worker),
:mod:`stack.prefill_router.routed` (the routed request's lifecycle),
:mod:`stack.prefill_router.view` (the policies' view of the pool),
:mod:`stack.prefill_router.state` (the components and their lifecycle) and
:mod:`stack.pool` (workers, health, accounting). ``create_app``, ``RouterState`` and
``error_response`` are re-exported here for their existing importers.
"""

from __future__ import annotations

import argparse
import logging

from stack.config import DeploymentConfig, load_config, parse_config
from stack.prefill_router.api.app import create_app
from stack.prefill_router.api.errors import error_response
from stack.prefill_router.front_door import fit_open_files
from stack.prefill_router.state import RouterState

__all__ = ["RouterState", "add_arguments", "config_from_args", "create_app", "error_response", "run"]


# -- CLI ------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="deployment YAML (see configs/router-example.yaml)")
    parser.add_argument("--host", help="bind address (default: router.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: router.port, 8000)")
    parser.add_argument(
        "--policy", help="routing policy (default: router.policy, the product's smetric-global)"
    )
    parser.add_argument(
        "--replica-id", help="this replica's id in the shared state (default: router.replica_id)"
    )
    parser.add_argument("--model-path", help="local model dir with tokenizer.json (+ chat template)")
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[@BOOTSTRAP_PORT][#KV_EVENTS]",
        help="add a prefill worker (repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="add a decode worker (repeatable)"
    )
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error")


def config_from_args(args) -> DeploymentConfig:
    cfg = load_config(args.config) if args.config else parse_config({})
    data = cfg.model_dump()
    if args.host:
        data["router"]["host"] = args.host
    if args.port is not None:
        data["router"]["port"] = args.port
    if args.policy:
        data["router"]["policy"] = args.policy
    if getattr(args, "replica_id", None):
        data["router"]["replica_id"] = args.replica_id
    if args.model_path:
        data["model"]["path"] = args.model_path
    if args.log_level:
        data["router"]["log_level"] = args.log_level
    for spec in args.prefill:
        kv = None
        if "#" in spec:
            spec, kv = spec.split("#", 1)
        bp = 8998
        if "@" in spec.split("://", 1)[-1]:
            spec, bps = spec.rsplit("@", 1)
            bp = int(bps)
        data["prefill"].append({"url": spec, "bootstrap_port": bp, "kv_events": kv})
    for url in args.decode:
        data["decode"].append({"url": url})
    return parse_config(data, source=args.config or "command line")


def run(args) -> int:
    from stack.prefill_router.drain import DrainingServer

    cfg = config_from_args(args)
    if not cfg.prefill:
        raise ValueError("no prefill workers: list them under 'prefill:' in the config or pass --prefill URL")
    level = cfg.router.log_level.lower()
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every health check and load poll at INFO: only from debug level
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    app = create_app(cfg, freeze_gc=True)
    print(
        f"smetric router: policy={cfg.router.policy} prefill={len(cfg.prefill)} decode={len(cfg.decode)} "
        f"on http://{cfg.router.host}:{cfg.router.port}",
        flush=True,
    )
    fit_open_files(cfg.router.front_door)
    door = app.state.front_door  # router.front_door: limits before a request reaches the app
    # SIGTERM drains first (stack/prefill_router/drain.py): /health 503, new requests refused,
    # what is held finishes; then uvicorn stops
    rc = cfg.router
    DrainingServer(
        door.server_config(app, rc.host, rc.port, level),
        app.state.router.drain,
        notice_s=rc.drain_notice_s,
        timeout_s=rc.drain_timeout_s if rc.drain_timeout_s is not None else rc.request_timeout_s,
    ).run()
    return 0
