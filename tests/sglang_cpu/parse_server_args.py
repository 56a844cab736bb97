"""Parse argument lists with SGLang's own parser (run under an interpreter with sglang).

stdin: JSON list of [name, argv] (or [name, argv, {"resolve": true}]) where argv is a full
`python -m sglang.launch_server ...` command. stdout: JSON {name: {"ok": bool, "error": str,
"fields": {...}}}. With "resolve", the parsed ServerArgs also go through SGLang's resolution
pipeline (``resolve_once``: what the server runs at start-up, where cross-flag refusals such as
--enable-lmcache with --enable-hierarchical-cache live); it reads the model's config, so the
argv must name a local model directory.
Test-only helper for tests/integration/test_sglang_args.py.
"""

import contextlib
import io
import json
import sys

from sglang.srt.server_args import prepare_server_args

FIELDS = (
    "model_path",
    "host",
    "port",
    "tp_size",
    "page_size",
    "device",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port",
    "disaggregation_ib_device",
    "enable_hierarchical_cache",
    "hicache_storage_backend",
    "hicache_ratio",
    "hicache_io_backend",
    "kv_events_config",
    "enable_metrics",
    "chunked_prefill_size",
    "mem_fraction_static",
    "max_total_tokens",
    "context_length",
    "enable_priority_scheduling",
    "disable_priority_preemption",
    "schedule_policy",
    "schedule_low_priority_values_first",
    "enable_lmcache",
    "lmcache_config_file",
    "api_key",
    "admin_api_key",
)


def main() -> None:
    items = json.load(sys.stdin)
    out = {}
    for name, argv, *opts in items:
        resolve = bool(opts and opts[0].get("resolve"))
        if "sglang.launch_server" in argv:
            argv = argv[argv.index("sglang.launch_server") + 1 :]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                sa = prepare_server_args(list(argv))
                if resolve:
                    sa.resolve_once()
            out[name] = {"ok": True, "fields": {f: getattr(sa, f, None) for f in FIELDS}}
        except SystemExit as e:  # argparse: unknown flag, bad choice, bad type
            out[name] = {"ok": False, "error": f"argparse exit {e.code}: {err.getvalue().strip()[-2000:]}"}
        except Exception as e:  # ServerArgs validation
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
