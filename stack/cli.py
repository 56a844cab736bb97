"""``smetric``: the command-line entry point.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported lazily so ``smetric sim`` never pulls in the web
stack and ``smetric --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from stack.paths import repo_relative

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("stack.commands.demo", "the main job: a side-by-side comparison on the shipped trace slice"),
    "demo-live": (
        "stack.commands.demo_live",
        "the main job, live: local PD stack, trace replay over HTTP, SMetric vs a baseline side by side",
    ),
    "sim": ("stack.commands.sim", "simulate one policy on a trace and write one JSON object of metrics"),
    "bench": (
        "stack.commands.bench",
        "sweep policies x rates (x settings) in parallel; results, summary, plots",
    ),
    "headroom": (
        "stack.commands.headroom",
        "where the prompt tokens that miss the TTFT SLO go, and a bound tighter than the clairvoyant one",
    ),
    "trace-stats": (
        "stack.commands.trace_stats",
        "workload statistics of a trace (reuse, sessions, balance)",
    ),
    "trace-export": ("stack.commands.trace_export", "convert a trace to the Mooncake JSONL format"),
    "advise": (
        "stack.commands.advise",
        "which configuration and how many instances for a recorded trace (router.record), with bands",
    ),
    "router": ("stack.prefill_router.service", "run the OpenAI-compatible SMetric router (FastAPI)"),
    "worker": ("stack.worker.cli", "run an SGLang-compatible worker (--emulate: CPU emulator)"),
    "up": ("stack.launch.cli", "bring up a local PD stack (mooncake_master, workers, router)"),
    "down": ("stack.launch.cli_down", "stop what `smetric up` started"),
    "replay": ("stack.commands.replay", "replay a trace against a live endpoint over HTTP"),
    "calibrate": (
        "stack.commands.calibrate",
        "measure a running SGLang engine and write its calibration file",
    ),
    "compare": (
        "stack.commands.compare",
        "live runs of our policies next to the real sglang-router on one emulated PD pool, with the sim",
    ),
}

DESCRIPTION = """\
smetric: SMetric prefill routing for PD-disaggregated SGLang pools, and a trace-driven
cluster simulator that runs the very same routing policies.

SMetric routes first-turn requests for balance, sticks follow-ups to the instance with the
highest local KV hit, and migrates a session when sticking would miss the TTFT SLO.

Start with `smetric demo` (simulated comparison on the shipped trace slice), then
`smetric sim --help` and `smetric bench --help`.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Raw descriptions, defaults shown; a default path inside the repository is shown relative to
    it (``stack/data/agentic_slice.jsonl.gz``), not as this machine's checkout path."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = super()._get_help_string(action)
        if (
            help_
            and "%(default)" in help_
            and isinstance(action.default, str)
            and os.path.isabs(action.default)
        ):
            help_ = help_.replace("%(default)s", repo_relative(action.default).replace("%", "%%"))
        return help_


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smetric", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=_HelpFormatter)
        sp.set_defaults(_module=module)
        if name in sys.argv[1:2]:  # only import the chosen subcommand's module
            mod = _load(module)
            if mod is not None:
                mod.add_arguments(sp)
    return parser


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if args.version:
        from stack import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 0
    mod = _load(args._module)
    if mod is None:
        print(f"smetric {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(mod.run(args) or 0)
    except CLIError as e:
        print(f"smetric {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"smetric {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"smetric {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
