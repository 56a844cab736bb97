"""``smetric worker --emulate``: run an SGLang-compatible emulated worker."""

from __future__ import annotations

import argparse

from stack.worker.settings import WorkerSettings, settings_from_config

_FLAGS = [
    # (flag, field, type, help)
    ("--host", "host", str, "address to bind"),
    ("--port", "port", int, "HTTP port"),
    ("--bootstrap-port", "bootstrap_port", int, "prefill: PD bootstrap port (default: the HTTP port)"),
    ("--name", "name", str, "worker name in logs and metrics"),
    ("--model", "model", str, "served model name"),
    (
        "--tokenizer",
        "tokenizer",
        str,
        "HF tokenizer dir (tokenizer.json [+ tokenizer_config.json]); default: built-in",
    ),
    ("--page-size", "page_size", int, "KV page (block) size in tokens"),
    ("--hardware", "hardware", str, "cost-model calibration: h20, h200 or a YAML path"),
    ("--time-factor", "time_factor", float, "real seconds per modelled GPU second"),
    (
        "--capacity-tokens",
        "capacity_tokens",
        int,
        "prefix-cache room in tokens (default: the hardware's HBM room)",
    ),
    (
        "--chunk-tokens",
        "chunk_tokens",
        int,
        "chunked-prefill token budget per step (default: the hardware's)",
    ),
    (
        "--decode-tpot-s",
        "decode_tpot_s",
        float,
        "modelled seconds per output token (default: the hardware's)",
    ),
    ("--kv-bytes-per-token", "kv_bytes_per_token", int, "real bytes of emulated KV per token"),
    (
        "--kv-events-endpoint",
        "kv_events_endpoint",
        str,
        "ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557",
    ),
    ("--kv-events-topic", "kv_events_topic", str, "KV-event topic"),
    ("--mooncake-master", "mooncake_master", str, "mooncake_master host:port (enables the global tier)"),
    (
        "--mooncake-metadata",
        "mooncake_metadata",
        str,
        "Mooncake metadata: http://host:port/metadata or P2PHANDSHAKE",
    ),
    ("--store-segment-bytes", "store_segment_bytes", int, "bytes this worker contributes to the global tier"),
    ("--bootstrap-timeout-s", "bootstrap_timeout_s", float, "how long a PD half waits for its twin"),
    ("--fault", "fault", str, "fault injection for tests: slow | malformed (see WorkerSettings.fault)"),
    ("--fault-delay-s", "fault_delay_s", float, "delay of the 'slow' fault, seconds"),
    (
        "--kv-transport",
        "kv_transport",
        str,
        "PD hand-off: mooncake (TransferEngine over TCP), http (fallback), auto",
    ),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate", action="store_true", help="run the CPU emulator (the only engine built in)")
    p.add_argument(
        "--mode", choices=["prefill", "decode", "colocated"], default=None, help="PD role (default prefill)"
    )
    p.add_argument("--config", default=None, help="deployment YAML: defaults from model + launch.emulator")
    for flag, dest, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    p.add_argument(
        "--no-fetch-time",
        dest="model_fetch_time",
        action="store_false",
        default=None,
        help="do not add the modelled link time to global-tier fetches",
    )
    p.add_argument(
        "--fault-control",
        action="store_true",
        default=None,
        help="serve POST /debug/fault to inject faults at run time (tests only: unauthenticated)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn / worker log level")


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
    s = settings_from_args(args)
    from stack.worker.server import serve

    serve(s, log_level=args.log_level)
    return 0
