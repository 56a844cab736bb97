"""Agent session hints: the session ids agents send, recorded but never routed on by SMetric.

llm-d's agent-identity plugin reads ``x-claude-code-session-id`` (Claude Code),
``session_id`` (Codex: a header; SGLang's request models also carry a body field of that
name) and ``x-session-affinity`` (opencode). The router takes the first present (after its
own ``x-session-token``) as the request's ``session_id``, which the ``session`` baseline
(and SGLang's cache-aware policy) route on; SMetric stays stateless and infers follow-ups
from the prompt. :class:`HintTracker` measures how often that inference agrees with the
hint: a hinted request whose session was seen before lands on the same prefill worker as
the session's previous request (``agree``) or not (``disagree``); a new session is
``first``. The tracker is bounded (LRU) and only feeds the metric.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

#: (header, source label) in the order they are read
HINT_HEADERS = (
    ("x-session-token", "session_token"),
    ("x-claude-code-session-id", "claude_code"),
    ("session_id", "codex"),
    ("x-session-affinity", "opencode"),
)


def session_hint(headers: Mapping[str, str], body: dict) -> tuple[str | None, str | None]:
    """(session id, its source) from the headers, else the body's ``session_id``."""
    for h, src in HINT_HEADERS:
        v = headers.get(h)
        if v:
            return v, src
    sid = body.get("session_id")
    if isinstance(sid, str) and sid:
        return sid, "body"
    return None, None


class HintTracker:
    """Session id -> the prefill worker of its last request (bounded LRU)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self.last: OrderedDict[str, int] = OrderedDict()

    def observe(self, sid: str, prefill_wid: int) -> str:
        """Record a hinted request's routing; returns ``agree``, ``disagree`` or ``first``."""
        prev = self.last.pop(sid, None)
        self.last[sid] = prefill_wid
        if len(self.last) > self.capacity:
            self.last.popitem(last=False)
        if prev is None:
            return "first"
        return "agree" if prev == prefill_wid else "disagree"
