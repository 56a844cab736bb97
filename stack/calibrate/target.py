"""What ``smetric calibrate --target URL`` measures, and how it can be timed.

Probed once before the sweep:

- ``/server_info``: a real SGLang worker, or the emulator (its ``emulator`` section: the time
  factor, the modelled seconds per wall second); its chunked-prefill budget, KV room and
  ``enable_metrics``. No ``/server_info`` but ``/v1/models``: a router (ours, in front of a PD
  pair or a colocated pool).
- a one-token request on native ``/generate``: its ``meta_info`` gives the prompt and cached
  token counts, and with SGLang's ``--enable-metrics`` the prefill's own forward time
  (``prefill_finished_time - forward_entry_time``). Without ``/generate``, ``/v1/completions``
  serves when its ``usage`` reports cached tokens (SGLang's ``--enable-cache-report``).

Timing: ``metrics`` reads the forward time from ``meta_info`` (no HTTP, tokenizer or
scheduling overhead; the emulator's are already modelled seconds); ``client`` times each
request on this side and divides it by the emulator's time factor: against a worker's
``/generate`` from the streamed answer's headers to its first token (the body's upload and
parse, which grow with the prompt, come before the headers and are left out), elsewhere (a
router, ``/v1/completions``, or ``wall`` asked) the whole wall clock, host overhead included
(it lands mostly in ``c_fwd``). Behind a router the answer's ``meta_info`` is the decode
worker's, so a router is timed on the client side (``--time-factor`` gives an emulated
pool's factor, which a router does not report). A target that gives neither forward timings
nor token counts is refused, naming the flag to add.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from stack.core.observations import TIMING_KEYS


class TargetError(ValueError):
    """The target cannot be calibrated as asked (the message says what to change)."""


@dataclass
class Target:
    url: str
    kind: str  # sglang | emulator | router
    mode: str  # SGLang's disaggregation_mode ("null": colocated), or "router"
    model: str
    endpoint: str  # /generate | /v1/completions
    metrics: bool  # the answers carry forward timings (--enable-metrics)
    timing: str = "client"  # metrics | client
    #: client timing's clock: ``stream`` (a worker's streamed /generate, from the answer's
    #: headers to its first token frame) or ``wall`` (a plain request's whole wall clock)
    client_clock: str = "wall"
    time_factor: float = 1.0
    time_factor_source: str = "real engine"
    chunk_tokens: int | None = None
    max_total_tokens: int | None = None
    max_model_len: int | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.kind} ({self.mode}) at {self.url}"

    def timing_text(self) -> str:
        """One line saying how the prefill times were taken."""
        if self.timing == "metrics":
            src = "modelled clock" if self.kind == "emulator" else "engine clock"
            return (
                "engine-side: meta_info prefill_finished_time - forward_entry_time "
                f"(SGLang --enable-metrics; {src})"
            )
        tf = "" if self.time_factor == 1.0 else f", divided by time factor {self.time_factor:g}"
        if self.client_clock == "stream":
            return (
                "client-side: each one-token request streamed, from the answer's headers to its first "
                f"token (the prompt's upload and parse left out){tf}"
            )
        return f"client-side: wall clock of each one-token request, host overhead included{tf}"


def _get_json(c: httpx.Client, url: str) -> Any | None:
    try:
        r = c.get(url)
    except httpx.HTTPError as e:
        raise TargetError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def _server_info(c: httpx.Client, url: str) -> dict | None:
    for path in ("/server_info", "/get_server_info"):
        got = _get_json(c, url + path)
        if isinstance(got, dict):
            return got
    return None


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _trial_ids(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def probe(
    c: httpx.Client,
    url: str,
    timing: str = "auto",
    time_factor: float | None = None,
    id_range: tuple[int, int] = (100, 1000),
) -> Target:
    """Find out what ``url`` is and how to time it (module docstring); raises
    :class:`TargetError` when it cannot be calibrated as asked."""
    url = url.rstrip("/")
    info = _server_info(c, url)
    models = _get_json(c, url + "/v1/models")
    model, max_len = "default", None
    if isinstance(models, dict) and models.get("data"):
        m0 = models["data"][0]
        model, max_len = str(m0.get("id") or model), _int(m0.get("max_model_len"))
    if info is None and models is None:
        raise TargetError(f"{url} answers neither /server_info nor /v1/models: is it an SGLang worker?")
    if info is not None:
        emu = info.get("emulator")
        kind = "emulator" if isinstance(emu, dict) else "sglang"
        mode = str(info.get("disaggregation_mode") or "null")
        if mode == "decode" or (mode == "prefill" and kind == "sglang"):
            raise TargetError(
                f"{url} is the {mode} half of a PD pair, which cannot serve a request alone: "
                "--target the router in front of the pair (or a colocated worker)"
            )
    else:
        kind, mode, emu = "router", "router", None
    t = Target(url, kind, mode, model, "/generate", False, max_model_len=max_len)
    if info is not None:
        chunk = _int(info.get("chunked_prefill_size"))
        t.chunk_tokens = chunk if chunk and chunk > 0 else None  # SGLang: -1 when chunking is off
        t.max_total_tokens = _int(info.get("max_total_num_tokens"))
    _set_time_factor(t, emu, time_factor)
    _trial(c, t, id_range)
    _choose_timing(t, timing)
    return t


def _set_time_factor(t: Target, emu: dict | None, given: float | None) -> None:
    if given is not None:
        if given <= 0:
            raise TargetError("--time-factor must be > 0")
        t.time_factor, t.time_factor_source = given, "--time-factor"
        if t.kind == "sglang" and given != 1.0:
            t.notes.append("a real engine runs at time factor 1: --time-factor overrides it as asked")
    elif emu is not None:
        t.time_factor = float(emu.get("time_factor") or 1.0)
        t.time_factor_source = "the emulator's /server_info"
    elif t.kind == "router":
        t.time_factor_source = (
            "assumed (a router does not report its pool's; --time-factor for an emulated pool)"
        )
        t.notes.append("behind a router the pool's time factor is unknown: 1.0 assumed (--time-factor)")


def _trial(c: httpx.Client, t: Target, id_range: tuple[int, int]) -> None:
    """One one-token request: which endpoint serves, and whether it reports forward timings."""
    ids = _trial_ids(random.Random(), 32, *id_range)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        r = c.post(t.url + "/generate", json=body)
        meta = r.json().get("meta_info") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        meta = None
    if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
        t.endpoint = "/generate"
        t.metrics = all(k in meta for k in TIMING_KEYS)
        return
    body = {"model": t.model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    try:
        r = c.post(t.url + "/v1/completions", json=body)
        usage = r.json().get("usage") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        usage = None
    details = (usage or {}).get("prompt_tokens_details") or {}
    if isinstance(usage, dict) and isinstance(details.get("cached_tokens"), int):
        t.endpoint, t.metrics = "/v1/completions", False
        t.notes.append("no native /generate: timed on /v1/completions (client side)")
        return
    raise TargetError(
        f"{t.url} gives neither forward timings nor token counts: native /generate answered no "
        "meta_info and /v1/completions reports no cached tokens. Start SGLang with "
        "--enable-metrics (forward timings in /generate's meta_info), or at least "
        "--enable-cache-report (cached tokens in usage, then timed on the client side)"
    )


def _choose_timing(t: Target, timing: str) -> None:
    if timing not in ("auto", "metrics", "client", "wall"):
        raise TargetError(f"--timing must be auto, metrics, client or wall, not {timing!r}")
    if timing == "metrics" and not t.metrics:
        flag = "smetric worker --emulate --enable-metrics" if t.kind == "emulator" else "--enable-metrics"
        raise TargetError(
            f"--timing metrics: {t.url}'s meta_info carries no {' / '.join(TIMING_KEYS)}; start it "
            f"with {flag}, or use --timing client"
        )
    if timing == "auto":
        timing = "metrics" if t.metrics and t.kind != "router" else "client"
        if t.kind == "router" and t.metrics:
            t.notes.append(
                "behind a router the answer's meta_info is the decode worker's: timed on the client side"
            )
    if timing == "wall":
        timing, t.client_clock = "client", "wall"
    elif timing == "client":
        # a router may hold its answer's headers until the pair has answered: its whole wall
        # clock (the client's TTFT) is what a router is timed by
        worker = t.kind != "router" and t.endpoint == "/generate"
        t.client_clock = "stream" if worker else "wall"
    t.timing = timing
