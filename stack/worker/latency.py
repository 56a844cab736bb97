"""Per-request latency histograms of the emulated worker, under SGLang's metric names so that a
dashboard reads the emulator and real SGLang alike (``sglang:time_to_first_token_seconds``,
``sglang:request_time_per_output_token_seconds``: SGLang 0.5.23's per-request TPOT,
(finished - first token) / (output tokens - 1)).

Plain counters, no lock: a worker's requests all run on its event loop. Rendered in the
Prometheus text format by :mod:`stack.worker.http.metrics`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: SGLang's default buckets (sglang/srt/observability/metrics_collector.py)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
TPOT_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
    0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip


@dataclass
class Histogram:
    """A cumulative histogram with fixed upper bounds (``+Inf`` implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v
        self.n += 1

    def exposition(self, name: str, help_: str, labels: str) -> str:
        """The histogram's lines; ``labels``: the other labels, ``k="v",...`` (no braces)."""
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            le = "+Inf" if b == float("inf") else repr(float(b))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(acc)}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {float(self.n)}")
        return "\n".join(out)


class Latency:
    """A worker's TTFT and per-request TPOT histograms."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def finished(self, ttft_s: float, e2e_s: float, output_tokens: int) -> None:
        """A request ended normally: its TTFT, and its TPOT when it made two tokens or more (a PD
        prefill half makes one)."""
        self.ttft.observe(ttft_s)
        if output_tokens > 1:
            self.tpot.observe(max(0.0, e2e_s - ttft_s) / (output_tokens - 1))

    def exposition(self, labels: str) -> str:
        return (
            self.ttft.exposition(
                "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels
            )
            + "\n"
            + self.tpot.exposition(
                "sglang:request_time_per_output_token_seconds",
                "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
                labels,
            )
        )
