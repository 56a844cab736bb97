"""The decode side of a request: which decode worker takes it, and the PD hand-off that sends
it to its prefill and decode workers.

- the decode choice: :func:`.decode_choice.pick_decode` (the least loaded healthy decode
  worker);
- the PD hand-off: :meth:`.handoff.PDForwarder.forward` (the same body, with SGLang's bootstrap
  fields, to both workers at once; decode's answer streamed back, prefill's drained), built
  from what both workers receive (:mod:`.bodies`), the calls to them (:mod:`.upstream`), the
  prefill half's timings (:mod:`.prefill_meta`) and the checks of the streamed answer
  (:mod:`.sse`).

The module decides nothing about prefill: the prefill worker comes from routing
(:mod:`stack.prefill_router.routing`).
"""
