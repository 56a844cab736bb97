"""stack.launch.router_spec: the one router builder of both launchers (emulated and SGLang)."""

from __future__ import annotations

import copy

import pytest

from stack.launch import emulated
from stack.launch.router_spec import router_extra_args, router_specs
from stack.launch.sglang import LaunchConfigError, load_yaml, sglang_process_specs
from stack.paths import configs_dir


def test_extra_args_are_strings_after_every_other_flag():
    specs = router_specs(
        command=["smetric"],
        config_path="/r.yaml",
        ports=[8000, 8001],
        host="10.0.0.1",
        env={"K": "V"},
        extra_args=router_extra_args({"extra_args": ["--log-level", 3]}),
        node="n0",
    )
    assert [s.name for s in specs] == ["router-0", "router-1"]
    assert specs[1].argv == [
        "smetric", "router", "--config", "/r.yaml", "--port", "8001", "--replica-id", "r1", "--log-level", "3",
    ]  # fmt: skip
    assert specs[0].ready_url == "http://10.0.0.1:8000/health" and specs[0].node == "n0"
    assert specs[0].env == {"K": "V"} and specs[0].env is not specs[1].env


def test_a_lone_router_reads_its_port_from_the_config():
    (spec,) = router_specs(
        command=["smetric"], config_path="c", ports=[8000], host="h", env={}, extra_args=[]
    )
    assert spec.name == "router" and spec.argv == ["smetric", "router", "--config", "c"]
    assert spec.node == "local"


@pytest.mark.parametrize("raw", [None, [], ()])
def test_no_extra_args(raw):
    assert router_extra_args({"extra_args": raw}) == [] and router_extra_args(None) == []


def _with_router_extra_args(cfg: dict, extra) -> dict:
    c = copy.deepcopy(cfg)
    c["launch"]["router"] = {**(c["launch"].get("router") or {}), "extra_args": extra}
    return c


@pytest.mark.parametrize("extra", ["--log-level debug", {"a": 1}])
def test_both_launchers_refuse_extra_args_that_are_not_a_list(extra):
    sg = _with_router_extra_args(load_yaml(configs_dir() / "qwen3-coder-30b-h200-1node.yaml"), extra)
    with pytest.raises(LaunchConfigError, match="launch.router.extra_args"):
        sglang_process_specs(sg)
    em = _with_router_extra_args(load_yaml(configs_dir() / "local.yaml"), extra)
    with pytest.raises(LaunchConfigError, match="launch.router.extra_args"):
        emulated.plan(em)


def test_both_launchers_append_the_same_router_extra_args():
    extra = ["--log-level", 2]
    sg = _with_router_extra_args(load_yaml(configs_dir() / "qwen3-coder-30b-h200-1node.yaml"), extra)
    em = _with_router_extra_args(load_yaml(configs_dir() / "local.yaml"), extra)
    p = emulated.plan(em)
    for specs in (sglang_process_specs(sg), emulated.process_specs(em, p, "/r.yaml")):
        (router,) = [s for s in specs if s.role == "router"]
        assert router.argv[-2:] == ["--log-level", "2"]
