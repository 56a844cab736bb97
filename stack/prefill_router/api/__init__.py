"""The router's HTTP layer, one module per concern.

- :mod:`~stack.prefill_router.api.app`: ``create_app``, wiring only (lifespan, routes, the
  raw-ASGI hot path).
- :mod:`~stack.prefill_router.api.endpoints`: the inference endpoints, one table (path ->
  name, body parser, error envelope, where it goes).
- :mod:`~stack.prefill_router.api.errors`: every error answer, in OpenAI's or Anthropic's
  shape (the envelopes), and FastAPI's error handlers.
- :mod:`~stack.prefill_router.api.parse`: request body and validation -> features, or a
  client error; :mod:`~stack.prefill_router.api.agents`: the agent APIs' parsing.
- :mod:`~stack.prefill_router.api.inference`: parse -> route -> PD hand-off -> answer, with
  the one retry on other workers (the routed request's own bookkeeping:
  :mod:`stack.prefill_router.routed`).
- :mod:`~stack.prefill_router.api.admin`: ``/admin/workers`` (an ``APIRouter``).
- :mod:`~stack.prefill_router.api.status`: ``/health``, ``/metrics``, ``/v1/models``.
- :mod:`~stack.prefill_router.api.tokenize`: ``/tokenize``.
"""
