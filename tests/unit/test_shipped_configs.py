"""What an operator deploys is the product: every shipped deployment config, and the router's
defaults, run the product's policy behind the router's default dispatch; the GPU configs give
SGLang the model's tool-call parser and a chunk size the calibration prices; the router refuses
a key it does not know, naming the nearest one.

A config that must run something else says why in a comment line ``# not the product: <why>``
(none does today); the drift test fails on any other difference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stack.bench.main_job import DEFAULT_POLICIES
from stack.config import PRODUCT_POLICY, RouterConfig, parse_config
from stack.dispatch import ROUTER_DISPATCH
from stack.launch.spec import READY_TIMEOUT_S, ready_timeout_s
from stack.paths import configs_dir

DEPLOYMENTS = sorted(p for p in configs_dir().glob("*.yaml"))
WAIVER = re.compile(r"^#\s*not the product:\s*\S", re.MULTILINE)


def _load(p: Path) -> dict:
    return yaml.safe_load(p.read_text()) or {}


def test_the_product_is_the_default_and_what_the_main_job_measures():
    assert RouterConfig().policy == PRODUCT_POLICY
    assert RouterConfig().dispatch == ROUTER_DISPATCH
    assert DEFAULT_POLICIES[0] == f"{PRODUCT_POLICY}+{ROUTER_DISPATCH.label()}"


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_shipped_config_runs_the_product(path):
    text = path.read_text()
    if WAIVER.search(text):
        return  # says why it runs something else
    router = parse_config(_load(path), source=path.name).router
    assert router.policy == PRODUCT_POLICY, f"{path.name}: policy {router.policy!r}"
    assert router.policy_params == {}, f"{path.name}: policy_params {router.policy_params}"
    assert router.dispatch == ROUTER_DISPATCH, f"{path.name}: router.dispatch differs"


def test_the_default_config_of_smetric_up_is_shipped_and_checked():
    assert configs_dir() / "local.yaml" in DEPLOYMENTS


@pytest.mark.parametrize(
    "path",
    [p for p in DEPLOYMENTS if (_load(p).get("launch") or {}).get("engine") == "sglang"],
    ids=lambda p: p.name,
)
def test_gpu_configs_fit_agents_and_real_sglang(path):
    from stack.launch.sglang import sglang_argvs

    cfg = _load(path)
    assert cfg["model"].get("tool_call_parser"), f"{path.name}: no tool-call parser: agents' tool calls break"
    calibration = _load(configs_dir() / "hardware" / f"{cfg['router']['hardware']}.yaml")
    argvs = dict(sglang_argvs(cfg))
    assert argvs
    for name, argv in argvs.items():
        assert argv[argv.index("--tool-call-parser") + 1] == cfg["model"]["tool_call_parser"], name
        if "--chunked-prefill-size" in argv:  # the calibration prices the chunks the workers run
            assert int(argv[argv.index("--chunked-prefill-size") + 1]) == calibration["chunk_tokens"], name
    # a 30B load takes minutes: the configured (or default) readiness wait allows it
    assert ready_timeout_s(cfg["launch"]) >= 600
    router = parse_config(cfg, source=path.name).router
    assert router.health_timeout_s > 1.0 and router.health_failures >= 2  # SGLang's /health takes >= 1 s


def test_ready_timeout_defaults_by_engine():
    assert ready_timeout_s({}) == READY_TIMEOUT_S["emulate"] == 60
    assert ready_timeout_s({"engine": "sglang"}) == READY_TIMEOUT_S["sglang"] >= 600
    assert ready_timeout_s({"engine": "sglang", "ready_timeout_s": 30}) == 30
    assert ready_timeout_s({"engine": "sglang"}, override=5) == 5


def test_emulated_workers_get_the_tool_call_parser():
    from stack.launch import emulated

    cfg = _load(configs_dir() / "local.yaml")
    argv = emulated.worker_argv(
        {"role": "decode", "name": "d0", "host": "127.0.0.1", "port": 1, "index": 0},
        cfg["model"],
        cfg["launch"],
        {"host": "127.0.0.1"},
    )
    assert argv[argv.index("--tool-call-parser") + 1] == "qwen3_coder"


@pytest.mark.parametrize(
    ("router", "named", "hint"),
    [
        ({"helth_timeout_s": 3}, "router.helth_timeout_s", "health_timeout_s"),
        ({"polcy": "smetric"}, "router.polcy", "policy"),
        ({"dispatch": {"oder": "fifo"}}, "router.dispatch.oder", "order"),
        ({"zzzqqq": 1}, "router.zzzqqq", None),
    ],
)
def test_unknown_router_key_is_an_error_naming_the_nearest(router, named, hint):
    with pytest.raises(ValueError) as ei:
        parse_config({"router": router}, source="x.yaml")
    msg = str(ei.value)
    assert named in msg and "unknown key" in msg
    assert (f"did you mean {hint!r}" in msg) if hint else ("did you mean" not in msg)


def test_router_stops_on_a_misspelt_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("router:\n  port: 0\n  health_timout_s: 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "stack.cli", "router", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "health_timout_s" in r.stderr and "did you mean 'health_timeout_s'" in r.stderr
