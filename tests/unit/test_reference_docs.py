"""The generated reference pages (docs/reference/, ``python -m stack.reference``) are current,
and what they are made from is complete: every config key has a description, every route says
what it does, and every key the launcher reads is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stack.config import LaunchConfig, LaunchK8sConfig, LaunchPoolConfig
from stack.paths import repo_root
from stack.reference import configuration, http_api, metrics
from stack.reference.pages import COMMAND, REFERENCE_DIR, check, generate, write

ROOT = repo_root()


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return generate()


def test_committed_pages_are_current(tmp_path: Path, pages: dict[str, str]) -> None:
    written = write(tmp_path)
    assert sorted(p.name for p in written) == sorted(pages)
    stale = [
        p.name
        for p in written
        if not (ROOT / REFERENCE_DIR / p.name).exists()
        or (ROOT / REFERENCE_DIR / p.name).read_text(encoding="utf-8") != p.read_text(encoding="utf-8")
    ]
    assert not stale, (
        f"{', '.join(stale)} under {REFERENCE_DIR} differ from what the code generates: run `{COMMAND}` "
        "and commit docs/reference/\n" + "\n".join(check(pages=pages))
    )


def test_check_reports_a_stale_page(tmp_path: Path, pages: dict[str, str]) -> None:
    write(tmp_path)
    (tmp_path / "metrics.md").write_text("old\n", encoding="utf-8")
    problems = check(tmp_path, pages)
    assert len(problems) == 1 and "metrics.md: stale" in problems[0] and COMMAND in problems[0]


def test_pages_are_deterministic(pages: dict[str, str]) -> None:
    assert generate() == pages


def test_every_config_key_has_a_description() -> None:
    missing = configuration.undocumented()
    assert not missing, f"config keys without a description (Field(description=...)): {missing}"


def test_every_route_says_what_it_does() -> None:
    app = http_api.build_app()
    assert http_api.routes(app)  # raises for a route with no docstring and no note
    assert not http_api.stale_notes(app), (
        "stack/reference/http_notes.py names routes the app no longer has, or routes whose endpoint "
        f"has a docstring now (delete those notes): {http_api.stale_notes(app)}"
    )


def test_every_router_metric_is_on_the_page() -> None:
    """Each metric the router's code creates is in the registry the page is made from (a metric
    created only once the router starts would be missing from it)."""
    files = sorted((ROOT / "stack" / "prefill_router").rglob("*.py"))
    made = _read_keys(r'(?:Counter|Gauge|Histogram|Summary)\(\s*"([a-z_]+)"', files)
    assert len(made) > 40
    assert made - {m.name for m in metrics.metrics()} == set()


def _read_keys(pattern: str, files: list[Path]) -> set[str]:
    return {k for p in files for k in re.findall(pattern, p.read_text(encoding="utf-8"))}


def test_every_launch_key_is_documented() -> None:
    """The keys stack/launch/ reads of ``launch``, a pool and ``launch.k8s`` are LaunchConfig's fields."""
    files = sorted((ROOT / "stack" / "launch").glob("*.py"))
    # keys with a leading underscore are the launcher's own notes to itself (``_plan``, ``_busy``)
    top = _read_keys(r'launch(?:\.get\(|\[)"([a-z][a-z_]*)"', files)
    top |= _read_keys(r'\["launch"\]\.get\("([a-z_]+)"', files)
    top |= _read_keys(r'get\("launch"\) or \{\}\)\.get\("([a-z_]+)"', files)
    pool = _read_keys(r'\bpool(?:\.get\(|\[)"([a-z_]+)"', files)
    k8s_file = [ROOT / "stack" / "launch" / "k8s.py"]
    k8s = _read_keys(r'\bk\.get\("([a-z_]+)"', k8s_file) | _read_keys(
        r'get\("k8s"\) or \{\}\)\.get\("([a-z_]+)"', k8s_file
    )
    assert len(top) > 20 and len(pool) > 10 and len(k8s) > 10  # the patterns still find the reads
    assert top - set(LaunchConfig.model_fields) == set(), "document these launch keys in stack/config.py"
    assert pool - set(LaunchPoolConfig.model_fields) == set(), "document these pool keys in stack/config.py"
    # ib_devices: read only to refuse it (launch.k8s.rdma_resource replaced it)
    assert k8s - set(LaunchK8sConfig.model_fields) == {"ib_devices"}, (
        "document these k8s keys in stack/config.py"
    )


def test_launch_defaults_match_the_launcher() -> None:
    from stack.config import LaunchMooncakeMasterConfig, LaunchRedisConfig
    from stack.launch import emulated, k8s, replicas
    from stack.launch.sglang_config import POOL_DEFAULTS

    kf = LaunchK8sConfig.model_fields
    assert kf["image"].default == k8s.DEFAULT_IMAGE
    assert kf["router_image"].default == k8s.DEFAULT_ROUTER_IMAGE
    assert kf["secret"].default == k8s.DEFAULT_SECRET
    assert kf["keys_secret"].default == k8s.DEFAULT_KEYS_SECRET
    assert LaunchRedisConfig.model_fields["password_env"].default == replicas.REDIS_PASSWORD_ENV
    master = LaunchMooncakeMasterConfig()
    assert {k: getattr(master, k) for k in emulated.DEFAULTS["mooncake_master"]} == emulated.DEFAULTS[
        "mooncake_master"
    ]
    pool = LaunchPoolConfig.model_fields
    for key in ("tp", "kv_events_topic", "transfer_backend", "metrics", "port_stride"):
        want = POOL_DEFAULTS["prefill"].get(key, emulated.DEFAULTS["prefill"].get(key))
        assert pool[key].get_default(call_default_factory=True) == want, key


def test_pages_name_no_machine_path(pages: dict[str, str]) -> None:
    for name, body in pages.items():
        assert not re.search(r"(?<![\w.~-])/(?:work|root|tmp|home/[\w.-]+|Users/[\w.-]+)/", body), name
