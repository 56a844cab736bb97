"""``smetric calibrate``: measure a running SGLang engine and fit the cost model the router and the
simulator price prefills with.

- :mod:`.design`: the designed sweep (new tokens x cached prefix, decode steps x context,
  repeats, held-out points);
- :mod:`.target`: what the target is and how it can be timed (native ``/generate`` with
  ``--enable-metrics``, or the client's wall clock);
- :mod:`.measure`: the measurement client (one request at a time: no queueing);
- :mod:`stack.core.observations`: per-request timings as rows (CSV / JSONL), what ``--from``
  reads and the router exports (in the shared core: the router learns from them too);
- :mod:`stack.core.fit`: non-negative least squares of the prefill and decode terms, held-out
  error (in the shared core: ``router.cost_model: learn`` fits with it);
- :mod:`.report`: the calibration file (``--hardware FILE`` takes it), the summary, the plot;
- :mod:`.run`: the command's steps in order.
"""
