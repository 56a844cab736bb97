"""`smetric compare`: our router's policies next to the real sglang-router, live and simulated.

For every router configuration -- our router with each of ``--policies``, and sglang-router
(PyPI ``sglang-router``, PD mode) with each of ``--peer-policies`` -- a fresh emulated PD pool
is started (``smetric up``: mooncake_master, emulated prefill and decode workers; caches start
cold), then the router in front of it, and the same slice is replayed over HTTP with
``smetric replay``'s load model (seeded Poisson session starts, closed-loop follow-ups).
``smetric sim`` runs the same trace, load, instance count and calibration for each
configuration: our policies as themselves, sglang-router's through their closest counterpart
in the simulator (``SIM_COUNTERPARTS``; an approximation, printed with the results).

sglang-router is launched as its docs show for PD mode::

    python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill URL BOOTSTRAP_PORT ... --decode URL --prefill-policy P --decode-policy round_robin

it sends each request to a prefill and a decode worker at once with bootstrap_host /
bootstrap_port / bootstrap_room added, as our router does, and streams decode's answer.

Writes DIR/compare.json (every run, every metric), DIR/compare.csv (one row per
configuration), DIR/compare.png (prefill TPS within SLO and TTFT, live next to sim) and
prints a table. With ``--repeat N`` every live configuration runs N times (the order
reversed on every other round) and the spread between runs is reported: differences within
it are noise. Times are modelled seconds (wall seconds / the emulator's time factor).
"""

from __future__ import annotations

import argparse
import sys

from stack.bench.compare.peer_router import PEER_POLICIES
from stack.bench.compare.session import compare
from stack.bench.live import add_window_arguments
from stack.paths import default_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--trace", default=str(default_trace()), help="agentic or Mooncake JSONL trace")
    p.add_argument(
        "--policies",
        default="smetric,smetric-global,lmetric,least-load,dynamo,round-robin",
        help="our router's policies (comma-separated; '' for none)",
    )
    p.add_argument(
        "--peer-policies",
        default="cache_aware,round_robin,power_of_two",
        help=f"sglang-router policies (comma-separated; '' for none; known: {', '.join(PEER_POLICIES)})",
    )
    p.add_argument("--prefill", type=int, default=2, help="emulated prefill workers")
    p.add_argument("--decode", type=int, default=1, help="emulated decode workers")
    p.add_argument("--time-factor", type=float, default=0.1, help="emulator wall seconds per modelled second")
    p.add_argument(
        "--rate",
        "--session-rate",
        dest="session_rate",
        type=float,
        default=0.03,
        help="session starts per modelled second",
    )
    add_window_arguments(p)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="wall seconds per request (and for draining after the last arrival)",
    )
    p.add_argument("--repeat", type=int, default=1, help="live runs per configuration (spread = noise)")
    p.add_argument("--config", default=None, help="deployment YAML for the pool (default configs/local.yaml)")
    p.add_argument("--no-mooncake", action="store_true", help="no mooncake_master (no global tier)")
    p.add_argument("--no-sim", action="store_true", help="live runs only")
    p.add_argument("--out", default="out/compare", help="output directory")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the live runs already in OUT/compare.json (same settings) and add --repeat more",
    )
    p.add_argument(
        "--resim",
        action="store_true",
        help="no live runs: take them from OUT/compare.json (or compare.partial.json), simulate again, "
        "rewrite the outputs (e.g. after a sim counterpart changed)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _split(s: str) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    return compare(args, _split(args.policies), _split(args.peer_policies))


def main(argv: list[str] | None = None) -> int:  # `python -m stack.commands.compare`
    p = argparse.ArgumentParser(prog="smetric compare", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
