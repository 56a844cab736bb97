"""Shared test configuration."""

from __future__ import annotations

import os

import pytest

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
