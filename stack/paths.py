"""Where the project's data lives (configs/, shipped traces)."""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def repo_root() -> Path:
    return _PKG.parent


def configs_dir() -> Path:
    env = os.environ.get("SMETRIC_CONFIGS")
    if env:
        return Path(env)
    return repo_root() / "configs"


def data_dir() -> Path:
    return _PKG / "data"


def default_trace() -> Path:
    return data_dir() / "agentic_slice.jsonl.gz"


def repo_relative(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the repository root when it lies inside it (e.g.
    ``stack/data/agentic_slice.jsonl.gz``), else as given: what tools record in files that
    are committed (``docs/results/*.json``), so that no machine's checkout path ends up there."""
    try:
        return Path(path).resolve().relative_to(repo_root()).as_posix()
    except (ValueError, OSError):
        return str(path)
