"""Every executor retries a failed or lost simulation once, then reports it in summary.json.

The same small sweep (3 policies x 2 rates, tiny simulations) runs in this process, in
local worker processes and as Ray tasks (on the session's loopback Ray instance), with a
task that raises once for one run, kills its worker once for another (a lost task; not in
this process) and always raises for a third.
"""

from __future__ import annotations

import multiprocessing

import pytest

from stack.bench.executors import make_executor
from stack.bench.process_executor import ProcessExecutor
from support.bench_faults import POLICIES, RATES, FaultyTask, sweep

WALL_CLOCK = {"sim_wall_s", "sim_requests_per_s"}
RAISE_ONCE = ("smetric", 0.004)
CRASH_ONCE = ("lmetric", 0.004)
ALWAYS = ("least-load", 0.008)


def by_run(rows: list[dict]) -> dict:
    return {(r["policy"], r["rate"]): {k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows}


@pytest.fixture(scope="module")
def clean_rows() -> dict:
    return by_run(sweep("local", 1, FaultyTask())["rows"])


@pytest.mark.parametrize(
    "executor,jobs,lost",
    [
        ("local", 1, None),  # in this process: no worker to lose
        ("local", 2, "WorkerLost: worker process "),
        ("ray", 2, "WorkerCrashedError: "),
    ],
)
def test_a_failed_or_lost_run_is_retried_once_then_reported(
    request, clean_rows, capsys, executor, jobs, lost
):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    task = FaultyTask(
        raise_once=frozenset({RAISE_ONCE}),
        crash_once=frozenset({CRASH_ONCE} if lost else set()),
        raise_always=frozenset({ALWAYS}),
    )
    res = sweep(executor, jobs, task)
    s = res["summary"]
    # the sweep completed without the run that always fails
    assert set(by_run(res["rows"])) == {(p, r) for p in POLICIES for r in RATES} - {ALWAYS}
    assert s["runs"] == 5 and s["executor"]["kind"] == executor
    [failed] = s["failed_runs"]
    assert (failed["policy"], failed["rate"], failed["attempts"]) == (*ALWAYS, 2)
    assert failed["setting"] == "default" and failed["dispatch"] == "immediate"
    assert failed["error"] == "InjectedFault: injected: least-load @ 0.008 always fails (attempt 1)"
    assert "least-load @ 0.008 (default) failed 2 times: InjectedFault" in capsys.readouterr().err
    # one raised, one lost its worker: both ran on their second attempt
    retried = {(r["policy"], r["rate"]): r for r in s["retried_runs"]}
    assert set(retried) == ({RAISE_ONCE, CRASH_ONCE} if lost else {RAISE_ONCE})
    assert retried[RAISE_ONCE]["error"] == "InjectedFault: injected: smetric @ 0.004 fails once"
    if lost:
        assert retried[CRASH_ONCE]["error"].startswith(lost)
    assert all(r["attempts"] == 2 for r in retried.values())
    # the recovered runs are the runs of a sweep without faults
    assert by_run(res["rows"]) == {k: v for k, v in clean_rows.items() if k != ALWAYS}


def test_no_retries_reports_the_first_failure():
    from stack.bench.executors import SweepContext
    from stack.bench.experiments import Setting
    from stack.bench.runner import Job
    from stack.sim.options import SimOptions

    base = SimOptions(instances=2, duration=1200.0)
    ctx = SweepContext(base.read_trace(), base, (Setting(),), "pd-disagg")
    ex = make_executor("local", ctx, jobs=2, task=FaultyTask(raise_once=frozenset({RAISE_ONCE})), retries=0)
    assert isinstance(ex, ProcessExecutor)
    try:
        done = ex.run(
            [Job(RAISE_ONCE[0], 0, RAISE_ONCE[1]), Job("lmetric", 0, 0.004)], on_done=lambda o: None
        )
        workers = multiprocessing.active_children()
    finally:
        ex.close()
    assert [o.job for o in done] == [Job("lmetric", 0, 0.004)]
    assert [(f.job, f.attempts) for f in ex.failures] == [(Job(RAISE_ONCE[0], 0, RAISE_ONCE[1]), 1)]
    assert len(workers) == 2 and not any(w.is_alive() for w in workers)  # close() ended them


@pytest.mark.parametrize("kind,jobs,address,needle", [
    ("threads", 1, None, "--executor must be one of local, ray"),
    ("local", 0, None, "--jobs must be >= 1"),
    ("local", 2, "127.0.0.1:6379", "--address needs --executor ray"),
])  # fmt: skip
def test_make_executor_refuses_bad_arguments(kind, jobs, address, needle):
    with pytest.raises(ValueError, match=needle):
        make_executor(kind, None, jobs=jobs, address=address)  # type: ignore[arg-type]
