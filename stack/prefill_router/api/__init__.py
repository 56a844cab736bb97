"""The router's HTTP layer, one module per concern.

- :mod:`~stack.prefill_router.api.app`: ``create_app``, wiring only (lifespan, routes, the
  raw-ASGI hot path).
- :mod:`~stack.prefill_router.api.errors`: OpenAI-shaped error answers and handlers.
- :mod:`~stack.prefill_router.api.parse`: request body and validation -> features, or a
  client error.
- :mod:`~stack.prefill_router.api.dispatch`: route -> PD hand-off -> answer -> release,
  with the one retry on another worker.
- :mod:`~stack.prefill_router.api.admin`: ``/admin/workers`` (an ``APIRouter``).
- :mod:`~stack.prefill_router.api.status`: ``/health``, ``/metrics``, ``/v1/models``.
"""
