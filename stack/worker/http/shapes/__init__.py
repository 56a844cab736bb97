"""Response bodies and stream chunks, one module per API shape.

Each module holds pure builders (a :class:`~stack.worker.http.relay.Completion` or an engine
item in, a JSON-ready dict out) and a :class:`~stack.worker.http.relay.StreamShape` for its
streamed form: :mod:`.sglang` (``/generate``), :mod:`.openai` (chat and text completions),
:mod:`.anthropic` (``/v1/messages``) and :mod:`.responses` (``/v1/responses``). A new API is
a new module here plus a ``routes_*`` module that parses its body; the request path
underneath does not change.
"""
