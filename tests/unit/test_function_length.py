"""No function in stack/ is longer than 120 lines: a reader finds one step in one short
function (issue 27's bar; the longest today are about 118). No class has more than 20 methods
or 400 lines: one concern a class (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path

STACK = Path(__file__).resolve().parents[2] / "stack"
LIMIT = 120


def test_no_function_in_stack_is_longer_than_the_limit():
    long = []
    for p in sorted(STACK.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = n.end_lineno - n.lineno + 1
                if lines > LIMIT:
                    long.append(f"{p.relative_to(STACK.parent)}:{n.lineno} {n.name} ({lines} lines)")
    assert not long, "\n".join(long)


#: a class holds one concern (issue 43): at most this many methods and lines
CLASS_METHODS, CLASS_LINES = 20, 400


def test_no_class_in_stack_is_larger_than_the_limit():
    large = []
    for p in sorted(STACK.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.ClassDef):
                methods = sum(isinstance(x, ast.FunctionDef | ast.AsyncFunctionDef) for x in n.body)
                lines = n.end_lineno - n.lineno + 1
                if methods > CLASS_METHODS or lines > CLASS_LINES:
                    large.append(
                        f"{p.relative_to(STACK.parent)}:{n.lineno} {n.name} ({methods} methods, {lines} lines)"
                    )
    assert not large, "\n".join(large)
