"""``smetric compare``'s library: our router's policies next to sglang-router, live on a fresh
emulated PD pool each and simulated with the same trace and load.

- ``peer_router.py``: sglang-router (PD mode) as a process: its command line, readiness, stop;
- ``live.py``: one live run (pool, router, replay) and each prefill worker's counters;
- ``simulated.py``: the simulator's counterpart of each configuration;
- ``aggregate.py``: one row per configuration (live mean and spread beside sim) and whether
  the simulator orders the configurations as the live runs do;
- ``report.py``: compare.csv, compare.png and the printed table;
- ``session.py``: the whole command: stored runs (``--append``, ``--resim``), the live rounds,
  the simulations, compare.json.
"""
