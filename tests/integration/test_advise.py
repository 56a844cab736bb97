"""`smetric advise` on a recording: the product's default and a baseline replayed over seeds at
the recorded rate and grown, a recommendation with its reason, a configuration section the
router accepts, and a capacity plan (issue 50)."""

from __future__ import annotations

import re

import pytest
import yaml

from stack.cli import main
from stack.commands.advise import PRODUCT, config_section, decode_instances, recommend
from stack.config import RecordConfig, parse_config
from stack.core.cost_model import load_hardware
from stack.dispatch import ROUTER_DISPATCH
from stack.prefill_router.record import Recorder, Served
from stack.traces.load import load_trace
from stack.traces.shipped import shipped

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The shipped short agentic trace, served request by request through the recorder."""
    d = tmp_path_factory.mktemp("rec")
    src = load_trace(shipped("agentic_short"))
    rec = Recorder(RecordConfig(enabled=True, dir=str(d), queue=1 << 20), "r0", 64)
    for r in sorted(src.requests, key=lambda r: (r.timestamp, r.idx))[:600]:
        keys = [hash((o, k)) & (2**63 - 1) for o, s, e in r.path for k in range(s, e)][: r.input_len // 64]
        s = Served(1_700_000_000_000 + round(r.timestamp * 1000), "chat", r.input_len, keys, None, False)
        s.status, s.output_tokens, s.output_from, s.end_ms = 200, r.output_len, "usage", s.arrival_ms + 1000
        rec.offer(s)
    rec.close(60)
    return d


def test_advise_prints_bands_a_recommendation_and_a_plan(recording, capsys):
    rc = main(
        [
            "advise",
            "--trace",
            str(recording),
            "--instances",
            "2",
            "--policies",
            "least-load",
            "--growth",
            "1,3000",
            "--duration",
            "600",
            "--jobs",
            "1",
            "--no-progress",
            "--plan",
            "--plan-instances",
            "1,2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "recorded rate" in out and "least-load" in out and "TPS in SLO" in out
    assert re.search(r"x1 .*least-load", out) and re.search(r"x3000 ", out)
    assert "recommended: " in out
    section = out[out.index("router:\n") :]
    section = section[: section.index("\n\n")] if "\n\n" in section else section
    cfg = parse_config(yaml.safe_load(section.split("capacity")[0]))  # the router accepts it
    assert cfg.router.policy in ("smetric-global", "least-load")
    assert "capacity:" in out and "prefill instances" in out
    assert "> 2" in out  # 3000 times the recorded rate: more than the counts tried


def test_recommendation_needs_a_win_at_every_seed():
    def rows(*tps):
        return [{"prefill_tps_within_slo": x} for x in tps]

    got = {(PRODUCT, 1.0): rows(100, 101, 99), ("least-load", 1.0): rows(100.5, 100, 100)}
    assert recommend(got, (PRODUCT, "least-load"), [1.0])[0] == PRODUCT  # within noise
    got[("least-load", 1.0)] = rows(110, 112, 111)
    choice, why = recommend(got, (PRODUCT, "least-load"), [1.0])
    assert choice == "least-load" and "beats" in why


def test_config_section_and_decode_sizing():
    ll = yaml.safe_load(config_section("least-load"))
    assert ll == {"router": {"policy": "least-load", "dispatch": {"order": "immediate"}}}
    d = yaml.safe_load(config_section(PRODUCT))["router"]
    assert d["policy"] == "smetric-global" and d["dispatch"]["order"] == "deadline-defer"
    cfg = parse_config({"router": d})  # the router reads back the product's default queue
    assert cfg.router.dispatch == ROUTER_DISPATCH
    trace = load_trace(shipped("agentic_short"))
    hw = load_hardware("h20")
    one, double = decode_instances(trace, hw, 1.0, 0.05), decode_instances(trace, hw, 2.0, 0.05)
    assert 1 <= one <= double
    assert decode_instances(trace, hw, 1.0, 1e-6) == -1  # no batch keeps to that TPOT
