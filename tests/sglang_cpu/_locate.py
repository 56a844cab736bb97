"""Find a Python interpreter that can import sglang (test-only helper)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

DEFAULT_VENV = Path(os.environ.get("SGLANG_VENV", "/opt/sglang-venv"))
INSTALL_HINT = "install it with `bash .ci/install-sglang.sh` (or --args for the parser only)"


@lru_cache(maxsize=1)
def sglang_python() -> str | None:
    """An interpreter where `import sglang.srt.server_args` works, or None."""
    cands = []
    if os.environ.get("SMETRIC_SGLANG_PYTHON"):
        cands.append(os.environ["SMETRIC_SGLANG_PYTHON"])
    if importlib.util.find_spec("sglang") is not None:
        cands.append(sys.executable)
    cands.append(str(DEFAULT_VENV / "bin" / "python"))
    for py in cands:
        if not Path(py).exists():
            continue
        try:
            r = subprocess.run(
                [py, "-c", "import sglang.srt.server_args"], capture_output=True, timeout=120, text=True
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return py
    return None


def skip_reason() -> str:
    return f"sglang is not importable (no $SMETRIC_SGLANG_PYTHON, not in this env, no {DEFAULT_VENV}): {INSTALL_HINT}"


def in_ci() -> bool:
    """CI sets CI=true: there a missing or broken SGLang environment is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail(reason: str) -> None:
    """Skip with the reason on a developer's machine; fail under CI=true (never a silent skip)."""
    import pytest

    if in_ci():
        pytest.fail(
            f"CI=true needs the SGLang environment here, and it is missing or broken: {reason}", pytrace=False
        )
    pytest.skip(reason)
