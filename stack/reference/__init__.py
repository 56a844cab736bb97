"""Generated reference pages that cannot drift: ``python -m stack.reference`` writes them.

Four pages under docs/reference/, each made from what the code itself holds:

- ``configuration.md``: the deployment config's pydantic models (:mod:`stack.config`, the
  dispatch spec it nests, and the ``launch`` section's :class:`~stack.config.LaunchConfig`):
  every key's YAML path, type, default and description;
- ``cli.md``: the argparse parsers of every ``smetric`` subcommand;
- ``http-api.md``: the router app's route table (FastAPI's own, read through ``app.openapi()``
  on an app that is built and never served), the inference endpoints' table and the error
  envelopes' real answers;
- ``metrics.md``: the Prometheus registry of a router app built with every optional part on.

``python -m stack.reference --check`` (and tests/unit/test_reference_docs.py) fails when a
committed page differs from what the code generates now.
"""
