"""Fault injection against a live local PD stack, counting what became of every request.

Each scenario starts real processes on loopback (emulated SGLang workers, the ``smetric router``
command, a real ``mooncake_master`` where it matters), drives a fixed number of requests at a
fixed concurrency (chat, completions and ``/generate``, half of them streamed), injects one fault
part-way through, and classifies every request:

- **ok**: 200 and a well-formed answer: one JSON object, or SSE events that all parse as JSON and
  end with ``data: [DONE]``;
- **clean error**: the client was told, in a form an OpenAI client understands: a 4xx/5xx whose
  body is an OpenAI-shaped JSON error, an SSE stream that carries an error event (or a
  ``finish_reason`` of ``abort``) and still ends with ``[DONE]``, or a 200 whose
  ``finish_reason`` is ``abort``;
- **lost**: anything else: no answer within the deadline (a hang), a connection reset, a stream
  cut without an error event, a malformed body passed through, a 5xx without a JSON error.

A scenario passes when nothing is lost and the router's view matches the fault (the killed
worker is ejected, then readmitted once it is back). Used by ``tests/e2e/test_faults.py``
(``pytest -m faults``) and as a script that prints the table in ``docs/research/faults.md``::

    python -m stack.faults                       # every scenario
    python -m stack.faults --only decode_killed --requests 300 --concurrency 16
"""

from stack.faults.harness import (
    ADMIN_ENV,
    PAGE,
    Counts,
    FaultStack,
    WorkerSpec,
    classify_error,
    classify_json,
    classify_sse,
    drive,
    make_bodies,
    request_outcome,
)
from stack.faults.scenarios import (
    SCENARIOS,
    Result,
    decode_killed,
    hostile_client,
    malformed_worker,
    mooncake_master_stopped,
    prefill_killed,
    slow_worker,
)

__all__ = [
    "ADMIN_ENV",
    "PAGE",
    "SCENARIOS",
    "Counts",
    "FaultStack",
    "Result",
    "WorkerSpec",
    "classify_error",
    "classify_json",
    "classify_sse",
    "decode_killed",
    "drive",
    "hostile_client",
    "make_bodies",
    "malformed_worker",
    "mooncake_master_stopped",
    "prefill_killed",
    "request_outcome",
    "slow_worker",
]
