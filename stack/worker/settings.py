"""Settings of one emulated worker (from CLI flags, or a deployment YAML's sections)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

FAULTS = (None, "slow", "stall", "malformed")
#: settings that are secrets (never reported)
SECRET_FIELDS = ("api_key", "admin_api_key")


def disaggregation_mode(mode: str) -> str:
    """The ``disaggregation_mode`` a worker of ``mode`` reports in ``/server_info``, as SGLang
    spells it ("null" for a colocated worker)."""
    return "null" if mode == "colocated" else mode


@dataclass
class WorkerSettings:
    mode: str = "prefill"  # prefill | decode | colocated
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int | None = None  # prefill only; SGLang's --disaggregation-bootstrap-port
    name: str = ""
    model: str = "emulated-model"
    tokenizer: str | None = None  # HF tokenizer dir; None: the built-in hash tokenizer
    page_size: int = 64
    hardware: str = "h20"  # calibration name or YAML path (configs/hardware/)
    time_factor: float = 0.01  # emulated seconds = modelled GPU seconds * time_factor
    capacity_tokens: int | None = None  # prefix-cache room; None: hardware.hbm_kv_tokens
    chunk_tokens: int | None = None  # chunked-prefill budget per step; None: hardware's
    decode_tpot_s: float | None = None  # modelled seconds per output token; None: hardware's
    kv_bytes_per_token: int = 16  # real bytes of emulated KV per token (store + transfer)
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557 (bound by the worker)
    kv_events_topic: str = "kv"
    #: SGLang's ``replay_endpoint`` of ``--kv-events-config``: a ROUTER socket (bound by the
    #: worker) that replays the last 10,000 event batches to a subscriber that missed them
    #: (stack/worker/events.py); None: no replay
    kv_events_replay_endpoint: str | None = None
    dp_rank: int = 0
    mooncake_master: str | None = None  # host:port of mooncake_master; None: no global tier
    mooncake_metadata: str = "P2PHANDSHAKE"  # or http://host:port/metadata
    #: kv_tier lmcache: this worker's LMCache engine (stack.kv_tier.lmcache_engine_sidecar)
    #: as its global tier instead of the Mooncake store directly (stack/worker/lmcache_tier.py)
    lmcache_url: str | None = None
    store_segment_bytes: int = 256 << 20
    store_timeout_s: float = 2.0  # bound of one global-tier call on the request path
    store_retry_s: float = 5.0  # after a failed call the global tier is skipped this long
    store_key_prefix: str = ""  # "" matches the router's MooncakeExistence default keys
    model_fetch_time: bool = True  # add the modelled link time of global-tier fetches
    shared_nic: bool = False
    #: workers given the same file share one modelled link (NIC): the FIFO's state lives there
    #: (stack/worker/link.py); None: the worker's own link
    link_file: str | None = None
    transfer_arena_bytes: int = 64 << 20
    kv_transport: str = "auto"  # PD hand-off: mooncake (TransferEngine) | http (fallback) | auto
    bootstrap_timeout_s: float = 300.0  # SGLang's default wait for the PD twin
    stream_interval: int = 1  # tokens per SSE write after the first (SGLang's --stream-interval)
    max_natural_tokens: int = 64  # without ignore_eos, outputs end after 8..this many tokens
    #: SGLang's ``--tool-call-parser``: with one, a request whose ``tool_choice`` forces a call
    #: is answered with a tool call in its API's shape (stack/worker/tool_calls.py); without
    #: one, as text (as SGLang answers without a parser)
    tool_call_parser: str | None = None
    #: SGLang's --enable-metrics: answers' meta_info carry queue_time, forward_entry_time and
    #: prefill_finished_time (here from the modelled clock: their differences are modelled
    #: seconds), as SGLang's do with the flag (stack/worker/timing.py)
    enable_metrics: bool = False
    #: fault injection (tests, ``stack.faults``): None | "slow" (every HTTP answer,
    #: /health included, waits ``fault_delay_s``) | "stall" (generation requests wait
    #: ``fault_delay_s`` before they start, the rest answers at once: a prefill worker that
    #: stalls its PD hand-offs, so its decode twin's bootstrap times out) | "malformed" (generation endpoints answer 200
    #: with a broken JSON body or SSE stream, /v1/loads with nonsense); also settable at run
    #: time with ``POST /debug/fault {"fault": ..., "delay_s": ...}``
    fault: str | None = None
    fault_delay_s: float = 30.0
    #: serve ``POST /debug/fault`` (unauthenticated: tests only, off by default)
    fault_control: bool = False
    #: SGLang's ``--api-key`` / ``--admin-api-key``: the keys its endpoints require
    #: (stack.worker.http.auth); never shown in ``/server_info``
    api_key: str | None = None
    admin_api_key: str | None = None
    #: continue the router's trace (SGLang's ``--enable-trace``): a span per inference request,
    #: a child of the W3C ``traceparent`` it carries (stack/worker/http/tracing.py)
    enable_trace: bool = False
    #: where the spans go (SGLang's ``--otlp-traces-endpoint``); the protocol comes from
    #: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, SGLang's default, or http/protobuf)
    otlp_traces_endpoint: str = "localhost:4317"
    #: SGLang's ``--enable-priority-scheduling``: the prefill queue by the request's
    #: ``priority`` then arrival (stack/worker/scheduler.py); ``--disable-priority-preemption``
    #: and ``--schedule-low-priority-values-first`` as SGLang's (the emulator never preempts)
    enable_priority_scheduling: bool = False
    disable_priority_preemption: bool = False
    schedule_low_priority_values_first: bool = False

    def __post_init__(self):
        if self.mode not in ("prefill", "decode", "colocated"):
            raise ValueError(f"mode must be prefill|decode|colocated, not {self.mode!r}")
        if self.kv_transport not in ("auto", "mooncake", "http"):
            raise ValueError(f"kv_transport must be auto|mooncake|http, not {self.kv_transport!r}")
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be slow | malformed or unset, not {self.fault!r}")
        if int(self.stream_interval) < 1:
            raise ValueError(f"stream_interval must be >= 1, not {self.stream_interval!r}")
        if not self.name:
            self.name = f"{self.mode}-{self.port}"

    def to_dict(self) -> dict:
        """The settings, the keys left out (what ``/server_info`` shows)."""
        d = asdict(self)
        for k in SECRET_FIELDS:
            d.pop(k, None)
        return d

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def settings_from_config(path: str | Path | None) -> dict:
    """Worker defaults from a deployment YAML: ``launch.emulator`` plus model/mooncake hints."""
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    out: dict = {}
    model = data.get("model") or {}
    if isinstance(model, dict):
        for k_src, k_dst in (
            ("name", "model"),
            ("served_name", "model"),
            ("page_size", "page_size"),
            ("tool_call_parser", "tool_call_parser"),
            ("path", "tokenizer"),
            ("tokenizer", "tokenizer"),
        ):
            if model.get(k_src) is not None:
                out[k_dst] = model[k_src]
    emu = ((data.get("launch") or {}).get("emulator")) or {}
    names = WorkerSettings.field_names()
    for k, v in emu.items():
        if k in names:
            out[k] = v
    return out
