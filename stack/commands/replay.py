"""`smetric replay`: replay a trace against a live OpenAI-compatible endpoint over HTTP.

The simulator's load model, live: sessions start at the chosen rate (seeded Poisson, whole
sessions, as ``smetric sim`` draws them), an agent's first turn at its scheduled time, each
follow-up after its predecessor's answer plus the trace's think time. Requests are real
streamed chat completions whose content reproduces the trace's block structure (the same
block ids give the same text; follow-ups append to the previous turn's messages), with
output lengths forced (``max_tokens`` + ``ignore_eos``).

Times: ``--duration``, ``--warmup``, think times and session rates are in the trace's
(modelled) seconds, like ``smetric sim``; each is multiplied by ``--time-factor`` on the
wall clock. Against the emulated stack pass the emulator's factor (``smetric up`` prints
it; /server_info of a worker reports it under emulator.time_factor): TTFTs are then
reported in modelled seconds (wall / factor) and checked against the TTFT SLO, so the JSON
compares key by key with ``smetric sim`` on the same trace and load.

Prompt lengths: block texts are words of a vocabulary, one token each, so the target must
tokenize as the replay builds. Pass the target's tokenizer with ``--tokenizer DIR`` (a local
dir with its tokenizer.json; without it, common English words: about one token each in the
usual BPE vocabularies, but not in the tiny model of `smetric up`). Before sending anything
the replay asks the target (``GET /model_info``: tokenizer_path; ``POST /v1/tokenize``: counts,
as SGLang workers and the smetric router answer) to count probe prompts built like the
trace's, and refuses to start (exit 2) when the counts differ by more than 4 tokens + 5%,
naming the tokenizer to pass. Targets without those endpoints are replayed with a warning;
``--no-tokenizer-check`` skips the check.

Example (the local stack of `smetric up`, whose emulator runs at time factor 0.05 and whose
router and workers tokenize with the tiny model in the run dir, .smetric/run/tiny-model by
default; /model_info of the router names it)::

    smetric replay --target http://127.0.0.1:8000 --time-factor 0.05 \\
        --tokenizer .smetric/run/tiny-model \\
        --session-rate 0.01 --duration 1200 --warmup 300 --max-think 60 --out out/live.json

Output: one JSON object with the keys of ``smetric sim`` (requests, duration_s,
prefill_tps_within_slo, slo_attainment, ttft_p50/p90/p99, imbalance_mean/p99,
reuse_total/local/global, sticks, migrations, first_turns, ...) plus tpot_p50/p90, errors,
error_kinds and wall-clock figures. Reuse comes from the answers' usage / meta_info;
decisions (sticks, migrations, first turns) and load imbalance from the router's /metrics
when it has them (null otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stack.commands.simopts import add_client_arguments, add_load_arguments
from stack.replay.progress import replay_with_progress
from stack.sim.options import SimOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--target", required=True, help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    add_load_arguments(p)
    add_client_arguments(p)
    p.set_defaults(duration=600.0)
    g = p.add_argument_group("replay")
    g.add_argument(
        "--time-factor",
        type=float,
        default=1.0,
        help="wall seconds per modelled second (the emulator's time_factor; 1 against real GPUs)",
    )
    g.add_argument(
        "--max-inflight", type=int, default=256, help="at most this many requests in flight (client side)"
    )
    g.add_argument("--request-timeout", type=float, default=120.0, help="wall seconds allowed per request")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="wall seconds to wait for in-flight requests after the last arrival (default: the request timeout)",
    )
    g.add_argument("--max-wall", type=float, default=None, help="hard stop after this many wall seconds")
    g.add_argument("--slo-b", type=float, default=1.0, help="TTFT SLO fixed budget b in (modelled) seconds")
    g.add_argument(
        "--slo-a",
        type=float,
        default=0.0625,
        help="TTFT SLO per-token budget in seconds per 1k prompt tokens",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="local dir with the target's tokenizer.json (its /model_info tokenizer_path): block texts then use "
        "words that are exactly one token each (exact prompt lengths); default: common English words "
        "(approximate; refused when the target counts them otherwise)",
    )
    g.add_argument(
        "--no-tokenizer-check",
        action="store_true",
        help="start even when the target's /v1/tokenize counts the replay's prompts otherwise",
    )
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token for the target")
    g.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus endpoint of the router for decisions and load imbalance (default: TARGET/metrics; '' = none)",
    )
    p.add_argument("--out", default="-", help="write the JSON metrics here ('-' = standard output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    from stack.replay.driver import ReplayConfig

    opts = SimOptions.from_args(args)
    if opts.shared_prefix:
        raise ValueError("--shared-prefix is not supported by replay")
    slo = opts.slo()
    trace = opts.read_trace()
    spec = opts.load_spec(trace)
    cfg = ReplayConfig(
        target=args.target,
        trace=opts.trace,
        load=spec,
        time_factor=args.time_factor,
        max_inflight=args.max_inflight,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        max_wall=args.max_wall,
        slo=slo,
        tokenizer=args.tokenizer,
        model=args.model,
        api_key=args.api_key,
        fmt=opts.fmt,
        metrics_url=args.metrics_url,
        check_tokenizer=not args.no_tokenizer_check,
        clients=opts.client_model(),
    )
    cfg.validate()
    return cfg, trace


def run(args: argparse.Namespace) -> int:
    cfg, trace = config_from_args(args)
    show = not args.no_progress and sys.stderr.isatty()
    result = replay_with_progress(cfg, trace, f"replay {Path(args.trace).name}", show)
    from stack.commands.output import write_json

    out = write_json(result, args.out)
    if out is not None:
        print(
            f"wrote {out}: {result['requests']} requests, prefill TPS within SLO "
            f"{result['prefill_tps_within_slo']:.0f}, TTFT p50 {result['ttft_p50']}, errors {result['errors']}",
            file=sys.stderr,
        )
    return 0
