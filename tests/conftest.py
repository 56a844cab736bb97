"""Shared test configuration.

The tests are split by kind, one folder each, and every test carries its folder's marker:

- ``unit/``: the pure core (policies, dispatcher, cost model, simulator pieces, converters,
  parsers): no process, no server, no socket; ``pytest tests/unit`` runs in well under a minute;
- ``integration/``: one component against real neighbours in-process or on loopback (the
  router's ASGI app, an emulated worker, a real Redis or mooncake_master, SGLang's parser);
- ``e2e/``: whole local stacks as processes (`smetric up`, demo-live, faults, compare) and the
  real-SGLang CPU tier (marker ``sglang``).

``pytest -m unit`` / ``-m "not e2e"`` select by kind from anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

KINDS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))


pytest.register_assert_rewrite("support.bench_faults")  # its checks report like a test's

# Never reach a model hub from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free port, for this test. Fails (never skips) when
    redis-server is missing: see stack/launch/redis_server.py."""
    from stack.launch.redis_server import RedisServer

    with RedisServer(tmp_path) as r:
        yield r


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray instance on loopback for the module (2 CPUs, a small object store, no
    dashboard); its GCS address. Skips where Ray is not installed, except under CI (the
    project's setup installs the ``ray`` extra, so there its tests must run)."""
    from stack.bench.executors import LOOPBACK_ENV

    os.environ.setdefault(*LOOPBACK_ENV)  # read when Ray is imported: its servers on 127.0.0.1
    try:
        import ray
    except ImportError:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            raise
        pytest.skip("ray is not installed: pip install 'stack[ray]'")
    import support.bench_faults

    ray.init(
        num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False, logging_level="WARNING"
    )
    # the tests' fault-injecting task goes to Ray's workers by value (tests/ is not on their path)
    ray.cloudpickle.register_pickle_by_value(support.bench_faults)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.cloudpickle.unregister_pickle_by_value(support.bench_faults)
        ray.shutdown()
