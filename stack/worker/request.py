"""One request inside the emulated engine: its generation parameters, its prefill progress and
the engine's counters over all requests."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from stack.worker.tool_calls import ToolCall


class Aborted(Exception):
    pass


@dataclass
class GenParams:
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    #: the tool call the request forces (stack.worker.tool_calls): its arguments are the output
    tool_call: ToolCall | None = None


@dataclass
class Req:
    rid: str
    tokens: list[int]
    params: GenParams
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    t_arrive: float = field(default_factory=time.monotonic)
    t_enqueue: float = 0.0  # entered the engine (after parsing and tokenizing)
    t_runnable: float = 0.0  # runnable by the scheduler (queued, or its global-tier fetch done)
    hashes: list[int] = field(default_factory=list)  # engine page hashes (KV events)
    store_keys: list[str] = field(default_factory=list)  # global-tier keys, one per full page
    # prefill progress
    done_tokens: int = 0
    local_pages: int = 0
    global_pages: int = 0
    held: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_forward_entry: float = 0.0  # wall start of its first step on the modelled clock
    t_prefill_done: float = 0.0
    fetch_s: float = 0.0
    compute_model_s: float = 0.0
    store_write_s: float = 0.0
    store_written_pages: int = 0
    future: asyncio.Future | None = None
    aborted: bool = False
    #: SGLang's ``priority`` (the body's field, or the ``x-override-priority`` header):
    #: honoured with ``--enable-priority-scheduling`` (stack/worker/scheduler.py)
    priority: int | None = None

    @property
    def L(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.L - self.done_tokens

    @property
    def pd(self) -> bool:
        return self.bootstrap_room is not None and self.bootstrap_host not in (None, "", "fake")


#: SGLang's switch for its request-header overrides (``x-override-priority`` among them)
HEADER_OVERRIDES_ENV = "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"


def request_priority(body: Mapping, headers: Mapping[str, str] | None = None) -> int | None:
    """A request's SGLang ``priority``: the body's ``priority`` field (an integer or null),
    overridden by the ``x-override-priority`` header when the worker runs with
    ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES`` set, as SGLang's HTTP server does. Raises
    ``ValueError`` (a 400) on a value that is not an integer."""
    v = body.get("priority")
    if headers is not None and os.environ.get(HEADER_OVERRIDES_ENV, "").lower() in ("1", "true"):
        h = headers.get("x-override-priority")
        if h is not None:
            try:
                v = int(h)
            except ValueError:
                raise ValueError(f"x-override-priority must be an integer, got {h!r}") from None
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"priority must be an integer, got {v!r}")
    return v


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    abort_requests: int = 0  # POST /abort_request calls received (aborted: requests they ended)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_local: int = 0
    cached_tokens_global: int = 0
    computed_tokens: int = 0
    store_fetch_pages: int = 0
    store_fetch_bytes: int = 0
    store_fetch_seconds: float = 0.0
    store_write_pages: int = 0
    store_write_bytes: int = 0
    store_errors: int = 0
    kv_transfer_bytes_sent: int = 0
    kv_transfer_bytes_received: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_verified: int = 0
    kv_transfer_mismatch: int = 0
    bootstrap_timeouts: int = 0
    prefill_steps: int = 0
    ttft_sum: float = 0.0  # wall, HTTP arrival to the first token (prefill done / KV received)
    ttft_model_sum: float = 0.0  # modelled (HTTP arrival to the end of the last step)
    host_before_engine_s: float = 0.0  # wall, HTTP arrival to engine entry (parse, tokenize)
