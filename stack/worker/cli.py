"""``smetric worker --emulate``: run an SGLang-compatible emulated worker."""

from __future__ import annotations

import argparse

from stack.worker.settings import WorkerSettings, settings_from_config

# (WorkerSettings field, type, help): the flag is the field's name in kebab case
_VALUE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("host", str, "address to bind"),
    ("port", int, "HTTP port"),
    ("bootstrap_port", int, "prefill: PD bootstrap port (default: the HTTP port)"),
    ("name", str, "worker name in logs and metrics"),
    ("model", str, "served model name"),
    ("tokenizer", str, "HF tokenizer dir (tokenizer.json [+ tokenizer_config.json]); default: built-in"),
    ("page_size", int, "KV page (block) size in tokens"),
    ("hardware", str, "cost-model calibration: h20, h200 or a YAML path"),
    ("time_factor", float, "real seconds per modelled GPU second"),
    ("capacity_tokens", int, "prefix-cache room in tokens (default: the hardware's HBM room)"),
    ("chunk_tokens", int, "chunked-prefill token budget per step (default: the hardware's)"),
    ("decode_tpot_s", float, "modelled seconds per output token (default: the hardware's)"),
    ("kv_bytes_per_token", int, "real bytes of emulated KV per token"),
    ("kv_events_endpoint", str, "ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557"),
    ("kv_events_topic", str, "KV-event topic"),
    (
        "kv_events_replay_endpoint",
        str,
        "ZMQ ROUTER endpoint replaying the last 10,000 KV-event batches (SGLang's replay_endpoint)",
    ),
    ("mooncake_master", str, "mooncake_master host:port (enables the global tier)"),
    ("mooncake_metadata", str, "Mooncake metadata: http://host:port/metadata or P2PHANDSHAKE"),
    ("store_segment_bytes", int, "bytes this worker contributes to the global tier"),
    ("lmcache_url", str, "this worker's LMCache engine sidecar (kv_tier lmcache) as its global tier"),
    ("bootstrap_timeout_s", float, "how long a PD half waits for its twin"),
    ("fault", str, "fault injection for tests: slow | stall | malformed (see WorkerSettings.fault)"),
    ("fault_delay_s", float, "delay of the 'slow' and 'stall' faults, seconds"),
    ("stream_interval", int, "tokens per SSE write after the first (SGLang's --stream-interval)"),
    (
        "tool_call_parser",
        str,
        "SGLang's --tool-call-parser (e.g. qwen3_coder): a request whose tool_choice forces a call "
        "gets a tool call in its API's shape; without it, text (as SGLang answers without a parser)",
    ),
    ("kv_transport", str, "PD hand-off: mooncake (TransferEngine over TCP), http (fallback), auto"),
    (
        "link_file",
        str,
        "a file through which the workers given the same path share one modelled NIC for their "
        "global-tier fetches (one FIFO across processes; default: a link of this worker's own)",
    ),
    (
        "api_key",
        str,
        "require 'Authorization: Bearer <key>' on every endpoint but /health*, /metrics (SGLang's)",
    ),
    ("admin_api_key", str, "the only key /abort_request and /flush_cache accept (SGLang's --admin-api-key)"),
    (
        "otlp_traces_endpoint",
        str,
        "with --enable-trace: the OTLP collector (SGLang's flag; protocol from "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc or http/protobuf)",
    ),
)

# (flag, WorkerSettings field, argparse action, help) of the boolean settings
_SWITCHES: tuple[tuple[str, str, str, str], ...] = (
    (
        "--no-fetch-time",
        "model_fetch_time",
        "store_false",
        "do not add the modelled link time to global-tier fetches",
    ),
    (
        "--enable-metrics",
        "enable_metrics",
        "store_true",
        "as SGLang's flag: meta_info carries queue_time, forward_entry_time and prefill_finished_time "
        "(from the modelled clock: their differences are modelled seconds, whatever --time-factor)",
    ),
    (
        "--fault-control",
        "fault_control",
        "store_true",
        "serve POST /debug/fault to inject faults at run time (tests only: unauthenticated)",
    ),
    (
        "--enable-trace",
        "enable_trace",
        "store_true",
        "continue the traceparent of each inference request with a span of this worker (SGLang's flag)",
    ),
    (
        "--enable-priority-scheduling",
        "enable_priority_scheduling",
        "store_true",
        "SGLang's flag: prefill the waiting requests by their 'priority' (body field, or the "
        "x-override-priority header with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1), highest "
        "first, then by arrival; a request without one runs after every prioritised one",
    ),
    (
        "--disable-priority-preemption",
        "disable_priority_preemption",
        "store_true",
        "SGLang's flag: never preempt a running request for a waiting one (the emulator never "
        "does; without the flag it warns at start)",
    ),
    (
        "--schedule-low-priority-values-first",
        "schedule_low_priority_values_first",
        "store_true",
        "SGLang's flag: with --enable-priority-scheduling, lower 'priority' values run first",
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag defaults to None so that only the flags given override ``--config``."""
    p.add_argument("--emulate", action="store_true", help="run the CPU emulator (the only engine built in)")
    p.add_argument(
        "--mode", choices=["prefill", "decode", "colocated"], default=None, help="PD role (default prefill)"
    )
    p.add_argument("--config", default=None, help="deployment YAML: defaults from model + launch.emulator")
    for dest, typ, help_ in _VALUE_FLAGS:
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=typ, default=None, help=help_)
    for flag, dest, action, help_ in _SWITCHES:
        p.add_argument(flag, dest=dest, action=action, default=None, help=help_)
    p.add_argument("--log-level", default="warning", help="uvicorn / worker log level")
    p.add_argument(
        "--pool",
        default=None,
        metavar="JSON",
        help="run several workers in this process: a JSON list of flag lists, one per worker "
        '(e.g. \'[["--port", "30000", "--name", "p0"], ["--port", "30010", "--name", "p1"]]\'); '
        "flags given outside --pool apply to every member",
    )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    kw = settings_from_config(getattr(args, "config", None))
    for name in WorkerSettings.field_names():
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    return WorkerSettings(**kw)


def run(args: argparse.Namespace) -> int:
    if not args.emulate:
        from stack.cli import CLIError

        raise CLIError(
            "only the emulator is built in: pass --emulate (real workers: python -m sglang.launch_server)"
        )
    from stack.worker.server import serve, serve_many

    if args.pool:
        serve_many(pool_settings(args), log_level=args.log_level)
    else:
        serve(settings_from_args(args), log_level=args.log_level)
    return 0


def pool_settings(args: argparse.Namespace) -> list[WorkerSettings]:
    """One ``WorkerSettings`` per member of ``--pool``: the member's flags over the shared ones."""
    import json

    try:
        members = json.loads(args.pool)
    except ValueError as ex:
        raise ValueError(f"--pool: not JSON ({ex})") from None
    if not isinstance(members, list) or not members or not all(isinstance(m, list) for m in members):
        raise ValueError("--pool: a non-empty JSON list of flag lists")
    p = argparse.ArgumentParser(prog="smetric worker --pool member")
    add_arguments(p)
    out = []
    for m in members:
        own = p.parse_args([str(x) for x in m])
        for name in WorkerSettings.field_names():
            if getattr(own, name, None) is None and getattr(args, name, None) is not None:
                setattr(own, name, getattr(args, name))
        own.config = own.config or getattr(args, "config", None)
        out.append(settings_from_args(own))
    return out
