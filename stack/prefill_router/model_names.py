"""The ``model`` names the router serves (``router.models``; docs/router.md, "Model names").

Accepted: the served model's name (``model.name``), its aliases, a name matching one of the
accept patterns (by default ``claude-*``: Claude Code sends its own model names), any of those
followed by ``:adapter`` (SGLang's LoRA syntax, ``base:adapter``: the workers know their
adapters), and a request that names no model (SGLang serves its model then). Any other name
is answered 404 in the endpoint's API shape, as OpenAI and Anthropic answer an unknown model.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from stack.config import ModelNamesConfig


class ModelNames:
    """Which ``model`` names one router accepts (module docstring)."""

    def __init__(self, served: str, cfg: ModelNamesConfig) -> None:
        #: the names listed by ``/v1/models``: the served name first, then its aliases
        self.listed = [served, *(a for a in cfg.aliases if a != served)]
        self._exact = frozenset(self.listed)
        self._patterns = tuple(cfg.accept)

    def _base(self, name: str) -> bool:
        return name in self._exact or any(fnmatchcase(name, p) for p in self._patterns)

    def accepts(self, name: str) -> bool:
        """Whether a request naming ``name`` is served (an empty name names no model)."""
        if not name or self._base(name):
            return True
        base, sep, adapter = name.partition(":")
        return bool(sep and adapter) and self._base(base)
