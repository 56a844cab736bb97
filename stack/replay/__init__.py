"""Trace replay against a live OpenAI-compatible endpoint (``smetric replay``).

- :mod:`stack.replay.builder`: chat requests whose content reproduces a trace's block
  structure (the same block ids give the same text).
- :mod:`stack.replay.driver`: the simulator's load model over HTTP (httpx, asyncio).
- :mod:`stack.replay.metrics`: the same metric names as ``smetric sim``.
"""
