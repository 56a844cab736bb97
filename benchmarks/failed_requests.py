"""Which requests fail after their retries in one simulated run with the client model on.

    python benchmarks/failed_requests.py --instances 64 --seed 2 --rate 0.286 \\
        --policies "least-load,smetric-global+$(python -c 'from stack.dispatch import ROUTER_DISPATCH as R; print(R.label())')"

Runs each policy (``policy+order[:k=v...]`` behind that dispatch spec) at one session rate on
the agentic trace, with clients that time out and retry (``--clients`` of ``smetric bench``:
patience 600 s, 2 retries), and lists the measured requests that failed after their retries:
their prompt sizes, turns, and how many of them need a cold prefill longer than the clients'
patience (the cost model's seconds for the whole prompt uncached). Those cannot be served in
time by any policy once their prefix is not cached. The figures agree with ``smetric bench``'s
``failed_after_retries`` for the same cell (``benchmarks/dispatch_matrix.py`` prints the bench
command of each cell).
"""

from __future__ import annotations

import argparse
import collections
import statistics

from stack.bench.runner import dispatch_options, make_simulator
from stack.sim.options import SimOptions
from stack.traces import shipped


def failed_requests(opts: SimOptions, policy: str, rate: float) -> tuple[dict, list[tuple[int, int]]]:
    """The run's metrics and (prompt tokens, turn) of each measured request that failed after
    its retries."""
    if "+" in policy:
        policy, order = policy.split("+", 1)
        opts = dispatch_options(opts, order)
    trace = opts.read_trace()
    sim = make_simulator(trace, policy, opts.sim_config({}), opts.load_spec(trace, rate))
    failed: list[tuple[int, int]] = []
    retry_or_fail = sim.retries.retry_or_fail
    retries = sim.retries.model.max_retries

    def recorded(now, handle, retry_after, measured, refused):
        tr, _, _, att = handle
        if measured and att.n > retries:
            failed.append((tr.input_len, tr.turn))
        retry_or_fail(now, handle, retry_after, measured, refused)

    sim.retries.retry_or_fail = recorded
    return sim.run().metrics, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace", default=str(shipped("claude_code_agentic")), help="the trace (default: agentic)"
    )
    ap.add_argument("--policies", default="least-load", help="comma-separated, policy[+order:k=v...]")
    ap.add_argument("--rate", type=float, required=True, help="session starts per second")
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--hardware", default="h20")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    opts = SimOptions(trace=a.trace, instances=a.instances, hardware=a.hardware, seed=a.seed, clients=True)
    cost = opts.sim_config({}).hardware.cost
    patience = opts.client_model().patience_s
    for p in a.policies.split(","):
        m, failed = failed_requests(opts, p, a.rate)
        sizes = [L for L, _ in failed]
        beyond = sum(cost.cost(L, L) > patience for L in sizes)
        print(f"{p}")
        print(f"  measured requests served {m['requests']}, failed after retries {m['failed_after_retries']}")
        if failed:
            print(
                f"  prompt tokens of the failed: min {min(sizes)}, median {statistics.median(sizes):.0f}, "
                f"max {max(sizes)}; cold prefill of the smallest {cost.cost(min(sizes), min(sizes)):.0f} s"
            )
            print(
                f"  needing a cold prefill longer than the {patience:g} s patience: {beyond} of {len(failed)}"
            )
            turns = collections.Counter(t for _, t in failed)
            print(f"  turns: {', '.join(f'{t}: {n}' for t, n in sorted(turns.items()))}")


if __name__ == "__main__":
    main()
