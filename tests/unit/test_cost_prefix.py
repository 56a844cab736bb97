"""The recomputed-prefix term ``c_prefix`` (SGLang's torch_native attention on CPU): the cost
model, the calibration file, the simulator's forwards and `smetric calibrate`'s fit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from stack.core.cost_model import CostModel, Hardware, hardware_dict, load_hardware
from stack.core.fit import Sample, fit_prefill, prefix_pairs
from stack.sim.engine import GlobalTierSpec, SimConfig, Simulator
from stack.sim.load import LoadSpec
from stack.traces.load import load_trace
from support.traces import agentic_record, write_jsonl

TRUE = CostModel(c_linear=2e-3, c_attn=1.5e-6, c_fwd=0.1, c_prefix=2e-6)


def test_cost_adds_the_prefix_term_and_defaults_to_none():
    plain = CostModel(2e-3, 1.5e-6, 0.1)
    assert plain.c_prefix == 0.0
    assert TRUE.cost(128, 1128) == pytest.approx(plain.cost(128, 1128) + 2e-6 * 1000**2 / 2)
    assert TRUE.chunk(128, 1128) == pytest.approx(plain.chunk(128, 1128) + 2e-6 * 1000**2 / 2)
    assert TRUE.cost(500, 500) == pytest.approx(plain.cost(500, 500))  # nothing cached


def test_calibration_file_carries_it_only_when_set(tmp_path):
    h20 = load_hardware("h20")
    assert "c_prefix" not in hardware_dict(h20)["cost"]
    hw = dataclasses.replace(h20, cost=TRUE)
    p = tmp_path / "cpu.yaml"
    p.write_text(yaml.safe_dump(hardware_dict(hw)))
    assert load_hardware(str(p)).cost == TRUE


def _samples(model: CostModel, chunk: int) -> list[Sample]:
    out, k = [], 0
    for n in (128, 256, 512, 1024, 2048):
        for c in (0, 256, 1024, 3000):
            out.append(Sample((n, n + c), model.cost(n, n + c), k, k % 3 == 2))
            k += 1
    return out


def test_fit_recovers_the_prefix_term():
    got, fit = fit_prefill(_samples(TRUE, 4096), 4096, prefix="yes")
    for k in ("c_linear", "c_attn", "c_fwd", "c_prefix"):
        assert getattr(got, k) == pytest.approx(getattr(TRUE, k), rel=1e-3), k
    assert fit.names[-1] == "c_prefix" and fit.holdout_mape < 1e-3
    # auto takes it on such an engine, and never on one without it
    auto, f = fit_prefill(_samples(TRUE, 4096), 4096, prefix="auto")
    assert "c_prefix" in f.names and auto.c_prefix > 0
    gpu = CostModel(4.4e-5, 6e-9, 0.025)
    auto, f = fit_prefill(_samples(gpu, 4096), 4096, prefix="auto")
    assert "c_prefix" not in f.names and auto.c_prefix == 0.0
    with pytest.raises(ValueError):
        fit_prefill(_samples(gpu, 4096), 4096, prefix="maybe")


def test_prefix_pairs_sums_over_chunks():
    assert prefix_pairs(100, 1100, None) == 0.5 * 1000**2
    # 3 forwards of a fresh 2500-token prompt with a 1000-token budget: starts 0, 1000, 2000
    assert prefix_pairs(2500, 2500, 1000) == 0.5 * (0 + 1000**2 + 2000**2)


def test_simulator_prices_a_later_chunk_with_its_prefix(tmp_path):
    hw = Hardware(
        name="cpu", cost=TRUE, hbm_kv_tokens=1_000_000, chunk_tokens=1024, kv_bytes_per_token=1000,
        gpus_per_server=1, nic_gbps=8.0, link_efficiency=1.0, decode_tpot_s=0.0,
    )  # fmt: skip
    t = load_trace(write_jsonl(tmp_path / "a.jsonl", [agentic_record(0, 1, 0.0, 32)]))  # 2048 tokens
    cfg = SimConfig(instances=1, hardware=hw, global_tier=GlobalTierSpec.parse("none"))
    spec = LoadSpec(mode="compress", rate_scale=1.0, warmup=0.0, measure_until=math.inf)
    res = Simulator(t, "round-robin", cfg, spec).run()
    want = 2 * TRUE.c_fwd + TRUE.chunk(1024, 1024) + TRUE.chunk(1024, 2048)
    assert res.ttfts == [pytest.approx(want)]
