"""The traces shipped inside the package (``stack/data/``), by name.

``shipped("claude_code_agentic")`` is the path of ``stack/data/claude_code_agentic.jsonl.gz``
wherever the package is installed; ``stack/data/README.md`` says where each trace comes
from and what was changed.
"""

from __future__ import annotations

from pathlib import Path

from stack.paths import data_dir

#: name -> file in ``stack/data/``
SHIPPED: dict[str, str] = {
    "agentic_slice": "agentic_slice.jsonl.gz",  # 60 of the 470 agentic sessions (default trace)
    "claude_code_agentic": "claude_code_agentic.jsonl.gz",  # the 470-session agentic trace
    "agentic_short": "agentic_short.jsonl.gz",  # its short sessions (stack/traces/cut.py): the main job
    "mooncake_conversation": "mooncake_conversation.jsonl.gz",  # Mooncake FAST'25, conversation
    "mooncake_synthetic": "mooncake_synthetic.jsonl.gz",  # Mooncake FAST'25, synthetic
}


def shipped(name: str) -> Path:
    """Path of the shipped trace ``name`` (a key of :data:`SHIPPED`, or its file name)."""
    file = SHIPPED.get(name) or (name if name in SHIPPED.values() else None)
    if file is None:
        raise KeyError(f"no shipped trace {name!r} (shipped: {', '.join(SHIPPED)})")
    return data_dir() / file
