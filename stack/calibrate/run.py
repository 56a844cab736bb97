"""The steps of ``smetric calibrate``: probe the target, run the designed sweep one request at a
time, fit, write the calibration file and the plot (or fit recorded observations, ``--from``);
with ``--handoff ROUTER``, then measure the PD hand-off through a router
(:mod:`stack.calibrate.handoff`), alone on ``--base`` when no sweep is asked for."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stack.calibrate import handoff, report
from stack.calibrate.design import Design, make_design
from stack.calibrate.measure import Meter
from stack.calibrate.target import Target, probe
from stack.core.cost_model import Hardware, dump_hardware, hardware_path, load_hardware
from stack.core.fit import LinearFit, Sample, fit_decode, fit_prefill, held_out
from stack.core.observations import read_observations

#: a measurement whose engine-side queueing exceeds this share of its forward (and 5 ms) met
#: another client's request
_QUEUED_SHARE = 0.1


@dataclass
class Sweep:
    """What a sweep measured."""

    prefill: list[Sample] = field(default_factory=list)
    decode: list[Sample] = field(default_factory=list)
    queued: int = 0  # measurements that waited behind another request (metrics timing)
    unexpected_hits: int = 0  # prompts meant to be fresh that the engine had cached


@dataclass
class Options:
    out: Path
    plot: Path | None
    base: str = "h20"
    name: str | None = None
    timing: str = "auto"
    time_factor: float | None = None
    max_context: int = 32768
    max_new: int | None = None
    min_new: int = 128
    new_levels: int = 5
    cached_levels: int = 4
    decode_contexts: int = 3
    decode_steps: tuple[int, ...] = (8, 32)
    repeats: int = 3
    holdout_every: int = 5
    seed: int = 0
    id_range: tuple[int, int] = (100, 1000)
    request_timeout_s: float = 300.0
    chunk_tokens: int | None = None  # --from: the engine's chunked-prefill budget
    prefix_attention: str = "auto"  # fit c_prefix: auto | yes | no (fit.fit_prefill)
    reduce: str = "auto"  # a design point's repeats: auto | median | min (reduce_for)
    handoff_url: str | None = None  # a router in front of a PD pool: measure the hand-off
    handoff_levels: int = 6  # prompt lengths of the hand-off's design
    handoff_max: int = 8192  # its longest prompt (from --min-new)
    handoff_from: str | None = None  # a recording (router.record): fit the hand-off from its lines
    between_forwards: bool = True  # the hand-off's prefill workers hand over between forwards (SGLang)

    @property
    def handoff_source(self) -> str | None:
        """Where the hand-off comes from, in words (None: no hand-off asked for)."""
        if self.handoff_from:
            return f"from the recording {self.handoff_from}"
        return f"through {self.handoff_url}" if self.handoff_url else None


def reduce_for(t: Target, asked: str = "auto") -> str:
    """How a design point's repeats are reduced: ``min`` for a whole wall clock (a busy host
    only lengthens it), ``median`` otherwise (engine timings; and the streamed client clock,
    whose split at the answer's headers a late read can move either way)."""
    if asked != "auto":
        return asked
    return "min" if t.timing == "client" and t.client_clock == "wall" else "median"


def design_for(t: Target, o: Options) -> Design:
    """The sweep sized to the target: no prompt past its context or half its KV room."""
    max_context = o.max_context
    if t.max_model_len:
        max_context = min(max_context, t.max_model_len - max(o.decode_steps, default=1) - 8)
    if t.max_total_tokens:
        max_context = min(max_context, t.max_total_tokens // 2)
    max_new = o.max_new or t.chunk_tokens or 8192
    return make_design(
        max_context,
        max_new,
        min_new=o.min_new,
        new_levels=o.new_levels,
        cached_levels=o.cached_levels,
        decode_contexts=o.decode_contexts,
        decode_steps=o.decode_steps,
        repeats=o.repeats,
        holdout_every=o.holdout_every,
        seed=o.seed,
    )


def sweep(meter: Meter, d: Design, step: Callable[[str], None]) -> Sweep:
    """Run the design, one request at a time; ``step(label)`` after each measurement."""
    out = Sweep()
    for p in d.prefill:
        prefix = meter.fresh(p.cached_tokens) if p.cached_tokens else []
        if prefix:
            meter.warm(prefix)
        for _ in range(d.repeats):
            m = meter.prefill(prefix + meter.fresh(p.new_tokens))
            out.prefill.append(Sample((m.new_tokens, m.prompt_tokens), m.seconds, p.index, p.holdout))
            if m.queue_s > max(0.005, _QUEUED_SHARE * m.seconds):
                out.queued += 1
            if m.cached_tokens > p.cached_tokens:  # the engine had these ids before
                out.unexpected_hits += 1
            step(f"prefill n={p.new_tokens} cached={p.cached_tokens}")
    for p in d.decode:
        for _ in range(d.repeats):
            m = meter.decode(meter.fresh(p.context), p.steps)
            out.decode.append(Sample((m.context,), m.step_s, p.index, p.holdout))
            step(f"decode context={p.context} steps={p.steps}")
    return out


def calibrate_target(url: str, o: Options, console: Console) -> int:
    base = load_hardware(o.base)
    timeout = httpx.Timeout(o.request_timeout_s, connect=5.0)
    with httpx.Client(timeout=timeout) as c:
        t = probe(c, url, o.timing, o.time_factor, o.id_range)
        d = design_for(t, o)
        console.print(
            f"target: {t.describe()}, endpoint {t.endpoint}; time factor {t.time_factor:g} "
            f"({t.time_factor_source})\nprefill timings: {t.timing_text()}\n"
            f"design: {len(d.prefill)} prefill points x {d.repeats} repeats, {len(d.decode)} decode points "
            f"x {d.repeats}; 1 point in {o.holdout_every} held out; {d.requests()} requests, one at a time"
        )
        for note in t.notes:
            console.print(f"[yellow]note:[/yellow] {note}")
        total = d.repeats * (len(d.prefill) + len(d.decode))
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=console, transient=False) as bar:
            task = bar.add_task("measuring", total=total)
            res = sweep(Meter(c, t, o.id_range), d, lambda s: bar.update(task, advance=1, description=s))
    if res.unexpected_hits:
        console.print(
            f"[yellow]warning:[/yellow] {res.unexpected_hits} prompts meant to be fresh hit the engine's "
            "cache (another client sends the same token ids?): fitted on the engine's own counts"
        )
    if res.queued:
        console.print(
            f"[yellow]warning:[/yellow] {res.queued} measurements waited behind another request: "
            "the target was not idle (its figures may be off)"
        )
    how = reduce_for(t, o.reduce)
    cost, pf = fit_prefill(res.prefill, t.chunk_tokens or base.chunk_tokens, how, o.prefix_attention)
    df = fit_decode(res.decode, "min") if res.decode else None  # decode is always client-timed
    tpot = statistics.median(p.measured for p in df.points) if df is not None else None
    name = o.name or o.out.stem
    hw = report.build_hardware(
        name,
        cost,
        base,
        df,
        tpot,
        t.chunk_tokens,
        t.max_total_tokens,
        f"measured by smetric calibrate: {t.describe()}",
    )
    extra = {
        "target": t.describe(),
        "time_factor": t.time_factor,
        "timing_mode": t.timing,
        "client_clock": t.client_clock if t.timing == "client" else None,
        "repeats_reduced_to": how,
    }
    samples = _save_samples(o.out.with_suffix(".samples.jsonl"), res)
    console.print(f"raw measurements: {samples}")
    hf = handoff_of(hw, o, console)
    return _finish(hw, pf, df, t.describe(), t.timing_text(), o, console, d.repeats, extra, hf)


def _save_samples(path: Path, res: Sweep) -> Path:
    """Every raw measurement, one JSON line each (kind, inputs, seconds, design point, held out)."""
    rows = [
        {
            "kind": "prefill",
            "new_tokens": s.x[0],
            "context": s.x[1],
            "seconds": s.seconds,
            "point": s.point,
            "holdout": s.holdout,
        }
        for s in res.prefill
    ] + [
        {"kind": "decode", "context": s.x[0], "step_s": s.seconds, "point": s.point, "holdout": s.holdout}
        for s in res.decode
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def calibrate_from(path: str, o: Options, console: Console) -> int:
    """Fit recorded observations: rows that ran alone; one in each ``holdout_every`` held out
    (:func:`stack.core.fit.held_out`)."""
    base = load_hardware(o.base)
    obs = read_observations(path)
    alone = [ob for ob in obs if ob.alone]
    console.print(
        f"{len(obs)} observations from {path}, {len(alone)} of them alone (no other request in their "
        "forwards): fitting those"
    )
    hold = held_out(len(alone), o.holdout_every)
    samples = [
        Sample((ob.new_tokens, ob.context), ob.forward_s, i, bool(hold[i])) for i, ob in enumerate(alone)
    ]
    chunk = o.chunk_tokens or base.chunk_tokens
    cost, pf = fit_prefill(samples, chunk, prefix=o.prefix_attention)
    name = o.name or o.out.stem
    hw = report.build_hardware(
        name, cost, base, None, None, chunk, None, f"fitted by smetric calibrate from {Path(path).name}"
    )
    timing = "recorded forward times (meta_info prefill_finished_time - forward_entry_time)"
    hf = handoff_of(hw, o, console)
    return _finish(hw, pf, None, f"observations {Path(path).name}", timing, o, console, None, {}, hf)


def handoff_of(hw: Hardware, o: Options, console: Console) -> handoff.HandoffFit | None:
    """The PD hand-off asked for (a recording's, or measured through a router), or None."""
    if o.handoff_from:
        f = fit_recorded_handoff(hw, o, console)
    elif o.handoff_url:
        f = measure_handoff(hw, o, console)
    else:
        return None
    return handoff.between_forwards(f) if o.between_forwards else f


def fit_recorded_handoff(hw: Hardware, o: Options, console: Console) -> handoff.HandoffFit:
    """The PD hand-off from ``o.handoff_from``: each recorded first token less what the
    simulator prices itself (:func:`stack.calibrate.handoff.recorded_firsts`)."""
    from stack.traces.load import TraceError, recording_lines

    assert o.handoff_from is not None
    try:
        lines = recording_lines(o.handoff_from)
    except TraceError as e:
        raise ValueError(str(e)) from None
    firsts = handoff.recorded_firsts(lines)
    console.print(
        f"hand-off from {o.handoff_from}: {len(firsts)} of {len(lines)} recorded requests time a PD "
        f"first token with the prefill worker's own timing; {o.handoff_levels} prompt-length bins, "
        "each its median"
    )
    f = handoff.fit_recorded(firsts, o.handoff_levels, o.holdout_every, hw.kv_bytes_per_token)
    console.print(handoff.describe(f))
    return f


def measure_handoff(hw: Hardware, o: Options, console: Console) -> handoff.HandoffFit:
    """The PD hand-off through ``o.handoff_url``, the prefill priced by ``hw``."""
    assert o.handoff_url is not None
    design = handoff.handoff_design(o.min_new, o.handoff_max, o.handoff_levels, o.holdout_every)
    rng = random.Random()  # fresh prompts every run (see Meter)
    lo, hi = o.id_range

    def fresh(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    tf = o.time_factor or 1.0
    console.print(
        f"hand-off through {o.handoff_url}: {len(design)} prompt lengths {design[0].tokens}-"
        f"{design[-1].tokens} x {o.repeats} repeats, one at a time; time factor {tf:g}"
    )
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    timeout = httpx.Timeout(o.request_timeout_s, connect=5.0)
    with httpx.Client(timeout=timeout) as c, Progress(*cols, console=console) as bar:
        task = bar.add_task("hand-off", total=len(design) * o.repeats)
        samples = handoff.measure(
            c,
            o.handoff_url.rstrip("/"),
            design,
            o.repeats,
            fresh,
            tf,
            lambda s: bar.update(task, advance=1, description=s),
        )
    f = handoff.fit_handoff(samples, hw.cost, hw.kv_bytes_per_token)
    console.print(handoff.describe(f))
    return f


def calibrate_handoff(o: Options, console: Console) -> int:
    """``--handoff`` alone: ``--base`` (the pool's calibration) with the measured hand-off."""
    base = load_hardware(o.base)
    f = handoff_of(base, o, console)
    assert f is not None
    hw = handoff.with_handoff(base, f)
    head = (
        f"The PD hand-off measured by `smetric calibrate` {o.handoff_source}; every other "
        f"key from {o.base}.\n{handoff.describe(f)}"
    )
    # the base file's own provenance, if it has one, with the hand-off's beside it
    base_prov = yaml.safe_load(hardware_path(o.base).read_text()).get("calibration") or {}
    measured = {k: report.round_value(v) for k, v in f.as_dict().items()}
    prov = {"calibration": {**base_prov, "handoff": {**_handoff_where(o), **measured}}}
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(dump_hardware(hw, head, prov))
    console.print(f"calibration: {o.out} (use it: --hardware {o.out})")
    return 0


def _finish(
    hw,
    pf: LinearFit,
    df: LinearFit | None,
    source: str,
    timing: str,
    o: Options,
    console: Console,
    repeats,
    extra,
    hf: handoff.HandoffFit | None = None,
) -> int:
    head = report.header(source, timing, pf, df, o.base, repeats)
    prov = report.provenance(source, timing, pf, df, extra)
    if hf is not None:
        hw = handoff.with_handoff(hw, hf)
        head += f"\nThe PD hand-off, {o.handoff_source}: {handoff.describe(hf)}."
        measured = {k: report.round_value(v) for k, v in hf.as_dict().items()}
        prov["calibration"]["handoff"] = {**_handoff_where(o), **measured}
    out = report.write(o.out, hw, head, prov)
    report.summary(console, hw, pf, df, timing)
    console.print(f"calibration: {out} (use it: --hardware {out})")
    if o.plot is not None:
        png = report.plot(o.plot, pf, df, f"{hw.name}: {source}")
        console.print(f"plot: {png}")
    return 0


def _handoff_where(o: Options) -> dict[str, str]:
    return {"from_recording": str(o.handoff_from)} if o.handoff_from else {"through": str(o.handoff_url)}
