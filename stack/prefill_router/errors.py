"""The errors of a request's feature work, shared by the HTTP layer, the feature pool and the
dispatch queue: a client's mistake (:class:`ClientError`, answered 4xx), a client that left
(:class:`Cancelled`), a request refused for overload (:class:`Overloaded`), and the tokenizer's two early exits (:class:`OverContext`,
:class:`NeedsOffload`)."""

from __future__ import annotations


class ClientError(ValueError):
    """A problem with the client's request (answered 4xx, never 500; 400 by default, as OpenAI
    and SGLang answer a bad field: the OpenAI SDK raises ``BadRequestError`` for it)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class OverContext(Exception):
    """Raised by :meth:`Tokenizer.encode` once the prompt reaches ``limit`` tokens: it
    cannot fit the context, and the rest of it is not tokenized. ``tokens``: a lower bound
    (the count so far, or the bound from the text's length)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.tokens = tokens


class Cancelled(Exception):
    """The request's client went away while its features were being derived."""


class NeedsOffload(Exception):
    """Raised by :meth:`Tokenizer.encode` on a thread with an inline budget (see
    :func:`inline_budget`) when the text's uncached part is over it, before anything is
    tokenized: the caller hands the request to the feature pool instead."""


def over_context(tokens: int, context_length: int, param: str, at_least: bool = False) -> ClientError:
    """The 400 answer to a prompt of ``tokens`` tokens (``at_least``: a lower bound) at or
    over ``context_length``."""
    n = f"at least {tokens}" if at_least else str(tokens)
    return ClientError(
        f"the prompt has {n} tokens, over the model's context length of {context_length}",
        param=param,
        code="context_length_exceeded",
        status=400,
    )


class Overloaded(Exception):
    """The router refused a request for overload: ``reason`` is the dispatch queue's
    ``queue_full`` or ``max_queue_wait``, or ``feature_wait`` (it waited longer than
    ``router.feature_wait_s`` for a feature-pool thread)."""

    def __init__(self, reason: str, waited_s: float, retry_after_s: int) -> None:
        if reason == "queue_full":
            what = "queue full"
        elif reason == "feature_wait":
            what = f"waited {waited_s:.2f}s for a tokenizer thread"
        else:
            what = f"waited {waited_s:.2f}s in the queue"
        super().__init__(f"router overloaded ({what}); retry later")
        self.reason = reason
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s
