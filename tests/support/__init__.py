"""Helpers only the tests use (``tests/`` is on pytest's ``pythonpath``): ``router_harness``
(a loopback cluster of fake workers and the router), ``kv_mirror`` (a KV-event mirror),
``traces`` (synthetic traces), ``bench_faults`` (a bench task that fails on purpose)."""
