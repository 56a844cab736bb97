"""Serving apart from the lab: what runs in production imports nothing from the simulator, the
emulator or the tools that study it, and the simulator reaches the router's code only through
the shared core (issue 43).

The rule is read from the source, not from ``sys.modules``: every ``import`` and ``from``
statement in a module counts, including those inside functions (an import deferred to the
first call is still a dependency), and the rule holds for everything a serving module reaches,
directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

STACK = Path(__file__).resolve().parents[2] / "stack"

#: the rooms that run in production: the router, the decode hand-off and choice, the pool,
#: dispatch, the policies, the KV tiers, the shared core and the agent APIs
SERVING = ("prefill_router", "decode_router", "pool", "dispatch", "policies", "kv_tier", "core", "agent_apis")
#: the lab: the simulator, the emulated worker, benchmarks, replay, fault injection, the
#: subcommands and calibration (what serving needs of it lives in stack/core)
LAB = ("sim", "worker", "bench", "replay", "faults", "commands", "calibrate", "cli")
#: what the simulator may not reach: the live router's own rooms
ROUTER = ("prefill_router", "decode_router", "pool")


def _modules() -> dict[str, Path]:
    out = {}
    for p in STACK.rglob("*.py"):
        parts = list(p.relative_to(STACK.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def imports_of(name: str) -> set[str]:
    """The ``stack`` modules that module ``name`` imports, anywhere in its body."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for n in names:
            # `import stack.a.b` loads stack.a too; the rule is about the deepest module named
            while n and n not in MODULES:
                n = n.rpartition(".")[0]
            if n.startswith("stack."):
                found.add(n)
    return found


def room(name: str) -> str:
    return name.split(".")[1] if name.count(".") else ""


def reached_from(rooms: tuple[str, ...]) -> dict[str, str]:
    """Every module reached from the modules of ``rooms``, each with the module that first
    imported it (for the message)."""
    todo = [m for m in MODULES if room(m) in rooms]
    via = {m: "" for m in todo}
    while todo:
        m = todo.pop()
        for d in imports_of(m):
            if d not in via:
                via[d] = m
                todo.append(d)
    return via


def _chain(via: dict[str, str], m: str) -> str:
    steps = [m]
    while via.get(steps[-1]):
        steps.append(via[steps[-1]])
    return " <- ".join(steps)


def test_the_reader_sees_imports_anywhere_in_a_module():
    # a top-level import, a deferred one inside a function, and a relative one
    assert "stack.config" in imports_of("stack.prefill_router.state")
    assert "stack.core.fit" in imports_of("stack.prefill_router.learned_cost")
    assert "stack.dispatch.sglang_priority" in imports_of("stack.sim.engine")
    assert set(LAB) <= {room(m) for m in MODULES}, "a lab room named here no longer exists"


def test_serving_imports_nothing_from_the_lab():
    via = reached_from(SERVING)
    bad = sorted(m for m in via if room(m) in LAB)
    assert not bad, "serving reaches the lab:\n" + "\n".join(_chain(via, m) for m in bad)


def test_the_simulator_reaches_the_router_only_through_the_shared_core():
    via = reached_from(("sim",))
    bad = sorted(m for m in via if room(m) in ROUTER)
    assert not bad, "the simulator reaches the router:\n" + "\n".join(_chain(via, m) for m in bad)
