"""The emulated worker's HTTP layer: SGLang 0.5.23's worker API over ``Worker.execute``.

- :mod:`.app` -- ``build_app``: wiring only.
- :mod:`.parse` -- bodies in, ``Req`` out; every validation error's message.
- :mod:`.encoding` -- JSON bodies, SGLang's error body, SSE frames.
- :mod:`.relay` -- engine items to a collected body or an SSE stream.
- :mod:`.shapes` -- one module per API shape: the answer objects and stream chunks.
- :mod:`.endpoints` -- the inference endpoints, one table (POST path -> handler, error shape,
  fault).
- ``routes_*`` -- the handlers, grouped: ``sglang`` (``/generate``), ``openai``
  (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``),
  ``agents`` (``/v1/messages``, ``/v1/responses``), ``status`` (health, info, load), ``admin``
  (flush, abort), ``bootstrap`` (PD ``/kv/register``, ``/route``).
- :mod:`.metrics` -- ``/metrics``; :mod:`.faults` -- test fault injection (ASGI wrapper).

Hit accounting: ``meta_info.cached_tokens`` (SGLang's field, local + global) plus
``cached_tokens_local``, ``cached_tokens_global`` and an ``emulator`` block with timings.
"""
