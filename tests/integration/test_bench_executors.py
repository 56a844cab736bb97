"""The local executors retry a failed or lost simulation once, then report it in summary.json.

The scenario (support.bench_faults.check_retried_once_then_reported; on Ray in
test_bench_ray.py): a small sweep (3 policies x 2 rates, tiny simulations) with a task
that raises once for one run, kills its worker once for another (a lost task; not in this
process) and always raises for a third.
"""

from __future__ import annotations

import multiprocessing

import pytest

from stack.bench.executor_choice import make_executor
from stack.bench.process_executor import ProcessExecutor
from support.bench_faults import RAISE_ONCE, FaultyTask, check_retried_once_then_reported


@pytest.mark.parametrize(
    "jobs,lost",
    [
        (1, None),  # in this process: no worker to lose
        (2, "WorkerLost: worker process "),
    ],
)
def test_a_failed_or_lost_run_is_retried_once_then_reported(capsys, jobs, lost):
    check_retried_once_then_reported("local", jobs, lost, capsys)


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
