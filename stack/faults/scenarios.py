"""The fault scenarios: each starts a :class:`~stack.faults.harness.FaultStack`, drives a
batch of requests, injects one fault part-way through and checks the router's view of it
(:data:`SCENARIOS`, by name)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stack.faults import hostile
from stack.faults.harness import PAGE, Counts, FaultStack, WorkerSpec, drive, make_bodies
from stack.launch.loopback import mooncake_skip_reason


@dataclass
class Result:
    name: str
    fault: str
    counts: Counts
    checks: dict = field(default_factory=dict)  # name -> bool
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.counts.lost == 0 and all(self.checks.values())


def _run(coro):
    return asyncio.run(coro)


def _kill_and_restart(
    stack: FaultStack, w: WorkerSpec, res: Result, down_s: float = 1.0, delay_s: float = 0.0
):
    async def action() -> None:
        await asyncio.sleep(delay_s)
        t0 = time.monotonic()
        await asyncio.to_thread(stack.kill, w)
        ejected = await stack.wait_until(lambda: not stack.healthy(w), 15)
        res.checks["ejected"] = ejected is not None
        if ejected is not None:
            res.notes.append(f"ejected {time.monotonic() - t0:.1f} s after the kill")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(stack.start_worker, w)
        t1 = time.monotonic()
        back = await stack.wait_until(lambda: stack.healthy(w), 20)
        res.checks["readmitted"] = back is not None
        if back is not None:
            res.notes.append(f"readmitted {time.monotonic() - t1:.1f} s after the restart")

    return action


def _after(stack: FaultStack, res: Result, w: WorkerSpec | None, n: int, concurrency: int, deadline: float):
    """A batch after the fault is over: everything must succeed (and reach ``w`` again)."""
    before = stack.dispatched(w) if w is not None else 0
    counts, _ = _run(drive(stack.url, make_bodies(n, seed=9), concurrency, deadline))
    res.checks["all ok afterwards"] = counts.ok == counts.sent
    if w is not None:
        res.checks[f"{w.name} serves again"] = stack.dispatched(w) > before
    res.notes.append(f"afterwards: {counts.row()}")
    res.counts.merge(counts)


def prefill_killed(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """SIGKILL a prefill worker under load; restart it on the same ports."""
    res = Result("prefill_killed", "SIGKILL one of 2 prefill workers under load, restart it", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=1) as s:
        w = s.prefill[0]
        counts, tasks = _run(_drive_with(s, n, concurrency, deadline, {n // 3: _kill_and_restart(s, w, res)}))
        res.counts = counts
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        _after(s, res, w, 20, concurrency, deadline)
    return res


def decode_killed(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    res = Result("decode_killed", "SIGKILL one of 2 decode workers under load, restart it", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=2) as s:
        w = s.decode[0]
        # longer answers (64 tokens, ~2 s of streaming), and four streams of 300 tokens (~9 s)
        # sent just before the kill: it finds streams mid-way on both decode workers
        bodies = make_bodies(n, max_tokens=64)
        k = n // 3
        for j in range(4):
            ids = [(j * 977 + i * 13) % 30000 + 1 for i in range(200)]
            sp = {"max_new_tokens": 300, "ignore_eos": True}
            bodies[k - 4 + j] = ("/generate", {"input_ids": ids, "sampling_params": sp, "stream": True})
        at = {k: _kill_and_restart(s, w, res, delay_s=1.5)}
        counts, _ = _run(_drive_bodies(s, bodies, concurrency, deadline, at))
        res.counts = counts
        cut = counts.reasons.get("clean: stream error event", 0)
        res.checks["streams cut mid-way end with an error event"] = cut >= 1
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        _after(s, res, w, 20, concurrency, deadline)
    return res


def mooncake_master_stopped(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """Stop mooncake_master under load: global-tier lookups miss, serving goes on."""
    res = Result("mooncake_master_stopped", "SIGKILL mooncake_master under load (not restarted)", Counts())
    why = mooncake_skip_reason()
    if why is not None:
        res.checks["mooncake available"] = False
        res.notes.append(why)
        return res
    with FaultStack(log_dir, n_prefill=2, n_decode=1, mooncake=True) as s:
        marks: dict = {}

        async def stop_master() -> None:
            marks["global_before"] = await asyncio.to_thread(s.metric, "smetric_global_hit_tokens_total")
            assert s.master is not None
            await asyncio.to_thread(
                lambda: (os.killpg(s.master.proc.pid, signal.SIGKILL), s.master.proc.wait(10))
            )
            await asyncio.sleep(2.0)  # the router's existence cache lives 1 s
            marks["global_after_stop"] = await asyncio.to_thread(s.metric, "smetric_global_hit_tokens_total")

        bodies = make_bodies(n, shared_prefix=20 * PAGE)
        counts, tasks = _run(_drive_bodies(s, bodies, concurrency, deadline, {n // 3: stop_master}))
        res.counts = counts
        end = s.metric("smetric_global_hit_tokens_total")
        res.checks["global hits before the stop"] = marks.get("global_before", 0) > 0
        res.checks["no global hits after the stop"] = end == marks.get("global_after_stop", -1)
        res.notes.append(
            f"global-hit tokens: {marks.get('global_before', 0):g} before the stop, "
            f"+{end - marks.get('global_after_stop', end):g} after it"
        )
        _after(s, res, None, 20, concurrency, deadline)
    return res


def slow_worker(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A prefill worker that answers everything (health included) 30 s late; the router's request
    timeout is 8 s."""
    res = Result(
        "slow_worker", "a prefill worker answers every call 30 s late (router timeout 8 s)", Counts()
    )
    with FaultStack(log_dir, n_prefill=2, n_decode=1, router={"request_timeout_s": 8}) as s:
        w = s.prefill[0]

        async def slow() -> None:
            await asyncio.to_thread(s.set_fault, w, "slow", 30.0)
            t = await s.wait_until(lambda: not s.healthy(w), 15)
            res.checks["ejected"] = t is not None
            if t is not None:
                res.notes.append(f"ejected {t:.1f} s after slowing down")

        counts, _ = _run(_drive_with(s, n, concurrency, deadline, {n // 4: slow}))
        res.counts = counts
        res.notes.append(f"retries={s.metric('smetric_retries_total'):g}")
        # heal it: readmitted
        s.set_fault(w, None)
        res.checks["readmitted"] = _run(s.wait_until(lambda: s.healthy(w), 40)) is not None
        _after(s, res, w, 20, concurrency, deadline)
    return res


def handoff_stalled(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A prefill worker stalls its PD hand-offs (its generation requests start 30 s late; its
    /health answers at once) and decode gives up waiting for the KV after 5 s (SGLang's bootstrap
    timeout, ``--disaggregation-bootstrap-timeout``): decode answers each such request with a
    failure before its first token, which the router retries on the other prefill worker; no
    answer is an empty success, and the decode worker is never blamed (ejected)."""
    res = Result(
        "handoff_stalled", "a prefill worker stalls hand-offs; decode's bootstrap timeout is 5 s", Counts()
    )
    with FaultStack(log_dir, n_prefill=2, n_decode=1, worker_flags={"bootstrap_timeout_s": 5}) as s:
        w, d = s.prefill[0], s.decode[0]
        decode_up: list[bool] = []

        async def stall() -> None:
            await asyncio.to_thread(s.set_fault, w, "stall", 30.0)
            t_end = time.monotonic() + 10.0
            while time.monotonic() < t_end:
                decode_up.append(await asyncio.to_thread(s.healthy, d))
                await asyncio.sleep(0.25)

        counts, _ = _run(_drive_with(s, n, concurrency, deadline, {n // 4: stall}))
        res.counts = counts
        retries, ejections = s.metric("smetric_retries_total"), s.metric("smetric_ejections_total")
        res.notes.append(f"retries={retries:g}, ejections={ejections:g}")
        res.checks["retried"] = retries > 0
        res.checks["decode never ejected"] = bool(decode_up) and all(decode_up)
        s.set_fault(w, None)
        res.checks["healthy once fixed"] = _run(s.wait_until(lambda: s.healthy(w), 20)) is not None
        _after(s, res, w, 20, concurrency, deadline)
    return res


def malformed_worker(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A decode worker answers 200 with broken JSON bodies and broken SSE streams (its /health is
    fine, its /v1/loads is nonsense)."""
    res = Result("malformed_worker", "a decode worker answers 200 with malformed bodies/streams", Counts())
    with FaultStack(log_dir, n_prefill=2, n_decode=2) as s:
        w = s.decode[0]

        async def bad() -> None:
            await asyncio.to_thread(s.set_fault, w, "malformed")

        counts, _ = _run(_drive_with(s, n, concurrency, deadline, {n // 4: bad}))
        res.counts = counts
        retries, ejections = s.metric("smetric_retries_total"), s.metric("smetric_ejections_total")
        res.notes.append(f"retries={retries:g}, ejections={ejections:g}")
        s.set_fault(w, None)
        res.checks["healthy once fixed"] = _run(s.wait_until(lambda: s.healthy(w), 20)) is not None
        _after(s, res, w, 20, concurrency, deadline)
        res.checks["router alive"] = s.router_proc is not None and s.router_proc.poll() is None
    return res


def hostile_client(log_dir, n: int = 120, concurrency: int = 8, deadline: float = 60.0) -> Result:
    """A 64 MB header, then 1,000 slow bodies, each while a stream of small requests runs
    (:mod:`stack.faults.hostile`): the stream sees no error, no worker is ejected, and its p99
    stays within 2x of the quiet p99 measured just before (``n``: 2n requests per stream, at
    least 400; ``concurrency``: unused, the stream keeps 4 in flight)."""
    res = Result(
        "hostile_client",
        "a hostile client: a 64 MB header, then 1,000 slow bodies, each under a stream of small requests",
        Counts(),
    )
    per = max(2 * n, 400)
    # workers at the modelled GPU's own speed (time factor 1): a small request takes ~50 ms
    with FaultStack(log_dir, n_prefill=2, n_decode=1, worker_flags={"time_factor": 1.0}) as s:
        loads = (
            ("64 MB header", hostile.HeadersLoad(s.router_port)),
            ("1,000 slow bodies", hostile.SlowBodiesLoad(s.router_port)),
        )
        hostile.stream(s.url, 50, 99, deadline)  # warm: connections, caches
        for i, (name, load) in enumerate(loads):
            quiet = hostile.stream(s.url, per, 10 * i, deadline)
            with load as held:
                loaded = hostile.stream(s.url, per, 10 * i + 1, deadline)
                if isinstance(load, hostile.SlowBodiesLoad):
                    res.checks["1,000 slow bodies held open"] = (
                        hostile.still_open(held) == hostile.SLOW_BODIES
                    )
            if isinstance(load, hostile.HeadersLoad):
                got = load.sender.statuses
                res.checks["64 MB headers refused 431"] = 431 in got and set(got) <= {431, None}
                res.notes.append(f"64 MB headers sent: {len(got)} ({got.count(431)} answered 431)")
            for x in (quiet, loaded):
                res.counts.merge(x.counts)
            res.checks[f"{name}: every request ok"] = (quiet.counts.ok, loaded.counts.ok) == (per, per)
            res.checks[f"{name}: p99 within 2x quiet"] = loaded.p99 <= hostile.P99_FACTOR * quiet.p99
            res.notes.append(hostile.describe(name, quiet, loaded))
        res.checks["no worker ejected"] = s.metric("smetric_ejections_total") == 0 and all(
            w["healthy"] for w in s.admin_workers()
        )
        res.notes.append(f"front-door refusals: {hostile.refusals(s)}")
        res.checks["router alive"] = s.router_proc is not None and s.router_proc.poll() is None
    return res


async def _drive_with(
    s: FaultStack, n: int, concurrency: int, deadline: float, at: dict, max_tokens: int = 16
) -> tuple[Counts, list]:
    return await _drive_bodies(s, make_bodies(n, max_tokens=max_tokens), concurrency, deadline, at)


async def _drive_bodies(
    s: FaultStack, bodies, concurrency: int, deadline: float, at: dict
) -> tuple[Counts, list]:
    counts, tasks = await drive(s.url, bodies, concurrency, deadline, at)
    for t in tasks:
        await t  # the fault's own checks (ejection, readmission) finish
    return counts, tasks


SCENARIOS: dict[str, Callable[..., Result]] = {
    "prefill_killed": prefill_killed,
    "decode_killed": decode_killed,
    "mooncake_master_stopped": mooncake_master_stopped,
    "slow_worker": slow_worker,
    "handoff_stalled": handoff_stalled,
    "malformed_worker": malformed_worker,
    "hostile_client": hostile_client,
}
