"""Shared test configuration."""

from __future__ import annotations

import os

# Never reach a model hub from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
