"""The locks (requirements/): every dependency pyproject.toml names is pinned, inside its bounds, and
scripts/check_lock.py tells an environment that matches a lock from one that does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "requirements"


def _check_lock():
    spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check_lock = _check_lock()


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("dev", "ray", "mooncake"):
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if check_lock.normalize(r.name) != "stack"]


def test_every_project_dependency_is_pinned_within_its_bounds():
    pins = check_lock.read_lock(LOCKS / "project.lock.txt")
    for req in _project_requirements():
        name = check_lock.normalize(req.name)
        assert name in pins, f"{req} is in pyproject.toml but not in the lock: run bash scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (str(req), pins[name])


@pytest.mark.parametrize("lock", ["project.lock.txt", "sglang.lock.txt", "lmcache.lock.txt"])
def test_locks_pin_every_line(lock):
    pins = check_lock.read_lock(LOCKS / lock)
    assert len(pins) > 50
    assert all(v and v[0].isdigit() for v in pins.values())


def test_venv_locks_hold_what_their_installers_name():
    sglang = check_lock.read_lock(LOCKS / "sglang.lock.txt")
    assert sglang["sglang"] == "0.5.23" and sglang["sglang-router"] == "0.3.2" and sglang["smg"] == "1.13.0"
    lmcache = check_lock.read_lock(LOCKS / "lmcache.lock.txt")
    assert lmcache["lmcache"] == "0.5.6" and "mooncake-transfer-engine-non-cuda" in lmcache


def test_read_lock_skips_comments_options_and_markers(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text(
        "# head\n-c other.txt\nFoo_Bar==1.2  # via x\n    # via y\nbaz[extra]==3 ; python_version >= '3'\n"
    )
    assert check_lock.read_lock(p) == {"foo-bar": "1.2", "baz": "3"}
    p.write_text("foo>=1\n")
    with pytest.raises(SystemExit, match="not a pin"):
        check_lock.read_lock(p)


def test_differences_name_missing_wrong_and_extra():
    pins = {"a": "1", "b": "2", "c": "3"}
    have = {"a": "1", "b": "2.1", "d": "4", "pip": "24", "stack": "0.1.0"}
    diffs = check_lock.differences(pins, have, exact=False, allow=set())
    assert diffs == ["version: b is 2.1, the lock says 2", "missing: c==3"]
    diffs = check_lock.differences(pins, have, exact=True, allow=set())
    assert diffs[-1] == "not in the lock: d==4" and len(diffs) == 3
    assert check_lock.differences(pins, have, exact=True, allow={"D"})[-1] == "missing: c==3"
