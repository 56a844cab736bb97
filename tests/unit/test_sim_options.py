"""The simulator's options object, its router view and its session-id rule."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest

from stack.commands.simopts import add_cluster_arguments, add_load_arguments
from stack.core.types import SLO, Decision
from stack.kv_tier.prefix_cache import PrefixCache
from stack.paths import default_trace
from stack.policies import POLICIES, STAND_INS, PolicyContext, make_policy
from stack.policies.base import Policy
from stack.sim.engine import SimConfig, Simulator, window_overlap
from stack.sim.load import LoadSpec, resolve_load_mode
from stack.sim.options import SimOptions
from stack.sim.view import build_view
from stack.traces.load import load_trace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    add_load_arguments(p)
    return p


def test_from_args_matches_the_command_line_defaults():
    opts = SimOptions.from_args(_parser().parse_args([]))
    assert opts == SimOptions()
    opts = SimOptions.from_args(
        _parser().parse_args(
            ["--instances", "4", "--format", "agentic", "--param", "slack=2", "--slo-a", "125"]
        )
    )
    assert opts.instances == 4 and opts.fmt == "agentic" and opts.params == {"slack": 2.0}
    assert opts.slo() == SLO(b=1.0, a=0.125)


def test_from_mapping_rejects_unknown_names():
    assert SimOptions.from_mapping({"instances": 3}).instances == 3
    with pytest.raises(ValueError, match="instanse"):
        SimOptions.from_mapping({"instanse": 3})


def test_validation_happens_when_the_options_are_used():
    bad = SimOptions(instances=0)  # building never raises: a bench setting may override it
    with pytest.raises(ValueError, match="--instances"):
        bad.sim_config()
    assert bad.override(instances=2, link=None).sim_config().instances == 2
    with pytest.raises(ValueError, match="--slo-b"):
        SimOptions(slo_b=-1).slo()


def test_load_mode_auto_and_sweep_rates():
    agentic = load_trace(default_trace())
    assert resolve_load_mode(agentic) == "sessions"
    assert resolve_load_mode(agentic, "compress") == "compress"
    fake_clock = SimpleNamespace(has_global_clock=True)
    assert resolve_load_mode(fake_clock, "auto") == "compress"  # type: ignore[arg-type]
    opts = SimOptions(duration=3600.0, session_rate=0.5)
    assert opts.load_spec(agentic).session_rate == 0.5
    spec = opts.load_spec(agentic, rate=0.02)  # a sweep's rate replaces the rate options
    assert spec.mode == "sessions" and spec.session_rate == 0.02 and spec.rate_scale == 1.0
    spec = SimOptions(load_mode="compress").load_spec(agentic, rate=3.0)
    assert spec.session_rate is None and spec.rate_scale == 3.0


def test_window_overlap():
    assert window_overlap(0.0, 10.0, 2.0, 5.0) == 3.0
    assert window_overlap(3.0, 4.0, 2.0, 5.0) == 1.0
    assert window_overlap(6.0, 7.0, 2.0, 5.0) == 0.0
    assert window_overlap(1.0, 3.0, 2.0, math.inf) == 1.0


def _figures(
    cache: PrefixCache, q_tokens=0, q_seconds=0.0, n_jobs=0, free_at=0.0, a_tokens=0, decode=(0, 0, 0.0)
):
    return SimpleNamespace(
        cache=cache,
        q_tokens=q_tokens,
        q_seconds=q_seconds,
        n_jobs=n_jobs,
        a_tokens=a_tokens,
        link=SimpleNamespace(free_at=free_at),
        decode_running=decode[0],
        decode_tokens=decode[1],
        decode_step_s=decode[2],
    )


def test_build_view_is_a_pure_function_of_the_figures():
    path = ((1, 0, 4),)
    warm = PrefixCache(None)
    warm.insert(path)
    glob = PrefixCache(None)
    glob.insert(((1, 0, 2),))
    insts = [
        _figures(PrefixCache(None), 100, 0.5, 2, free_at=12.0, a_tokens=900),
        _figures(warm, n_jobs=1, decode=(3, 70_000, 0.0025)),
    ]
    v = build_view(10.0, insts, path, 256, 64, glob, 1e6)
    assert [s.index for s in v.instances] == [0, 1]
    assert v.instances[0].local_hit == 0 and v.instances[0].fetch_backlog_s == 2.0
    assert v.instances[0].queued_tokens == 100 and v.instances[0].running == 2
    assert v.instances[0].active_tokens == 900
    assert (v.instances[0].decode_running, v.instances[0].decode_tokens) == (0, 0)
    d = v.instances[1]
    assert (d.decode_running, d.decode_tokens, d.decode_step_s) == (3, 70_000, 0.0025)
    assert d.running == 1 + 3  # colocated: the decoding requests count as running
    assert v.instances[1].local_hit == 255  # capped: the last prompt token is computed
    assert v.global_hit == 128 and v.now == 10.0 and v.fetch_tokens_per_s == 1e6
    again = build_view(10.0, insts, path, 256, 64, glob, 1e6, out=v)
    assert again is v and v.instances[1].local_hit == 255


class _Spy(Policy):
    """Round robin that records the session ids it is given."""

    name = "spy"

    def __init__(self, ctx: PolicyContext, needs: bool) -> None:
        super().__init__(ctx)
        self.needs_session_id = needs
        self.seen: set = set()
        self.k = 0

    def choose(self, req, view):
        self.seen.add(req.session_id)
        self.k += 1
        return Decision(self.k % len(view.instances))


@pytest.mark.parametrize("needs", [False, True])
def test_session_ids_only_for_policies_that_need_them(needs):
    trace = load_trace(default_trace())
    cfg = SimConfig(instances=2)
    pol = _Spy(PolicyContext(cost=cfg.hardware.cost, slo=cfg.slo), needs)
    Simulator(trace, pol, cfg, LoadSpec(mode="sessions", duration=600.0, warmup=0.0, seed=1)).run()
    assert (pol.seen == {None}) is not needs and pol.seen


def test_stand_ins_are_built_by_name_but_are_not_our_policies():
    ctx = PolicyContext(cost=SimConfig().hardware.cost, slo=SLO())
    for name in STAND_INS:
        assert name not in POLICIES
        assert make_policy(name, ctx).name == name


def test_param_booleans_are_booleans_not_truthy_text():
    from stack.sim.options import parse_params

    assert parse_params(["count_global=false", "x=TRUE", "slack=1.5", "name=stay"]) == {
        "count_global": False,
        "x": True,
        "slack": 1.5,
        "name": "stay",
    }
