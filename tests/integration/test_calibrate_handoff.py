"""``smetric calibrate --handoff ROUTER``: the PD hand-off measured through our router in front
of an emulated PD pair whose calibration carries known hand-off terms (h200's prefill, a
100 ms bootstrap and a 40 Gbit/s transfer). The decode worker waits them (the emulator charges
the engines' part of the hand-off); calibrate, pricing the prefill with h200, recovers them
within what the real HTTP hops and the emulator's host work add."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import yaml

from stack.cli import main
from stack.core.cost_model import HandoffCost, load_hardware
from support.emulated_pd import emulated_pd

pytestmark = pytest.mark.timeout(180)

H200 = load_hardware("h200")
TRUE = HandoffCost(bootstrap_s=0.1, transfer_gbps=40.0)
PER_TOKEN = H200.kv_bytes_per_token * 8 / (TRUE.transfer_gbps * 1e9)  # 19.7 us


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """1 prefill + 1 decode emulated worker on h200 with TRUE's hand-off, time factor 1; our
    router in front (smetric policy), pricing with h200."""
    with emulated_pd(
        tmp_path_factory.mktemp("handoff"), replace(H200, name="h200-handoff", handoff=TRUE), "h200"
    ) as pair:
        yield pair


def test_the_decode_worker_waits_the_modelled_hand_off(pd):
    url, dec = pd
    ids = list(range(100, 100 + 2048))
    r = httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=60
    )
    assert r.status_code == 200, r.text
    emu = r.json()["meta_info"]["emulator"]
    assert emu["handoff_model_s"] == pytest.approx(TRUE.bootstrap_s + 2048 * PER_TOKEN)


def test_calibrate_recovers_the_hand_off(pd, tmp_path):
    url, _ = pd
    out = tmp_path / "pool.yaml"
    args = ["calibrate", "--handoff", url, "--base", "h200", "--out", str(out), "--time-factor", "1"]
    args += ["--repeats", "2", "--handoff-levels", "6", "--min-new", "256", "--handoff-max", "8192"]
    assert main(args) == 0
    hw = load_hardware(str(out))
    assert hw.cost == H200.cost  # --handoff alone: the prefill is --base's
    h = hw.handoff
    # the real hops and the emulator's host work (parse, hashing, the KV's bytes) come on top
    assert TRUE.bootstrap_s * 0.9 <= h.bootstrap_s <= TRUE.bootstrap_s + 0.1
    assert TRUE.transfer_gbps * 0.5 <= h.transfer_gbps <= TRUE.transfer_gbps * 1.1
    assert not h.first_step and h.hop_s == 0.0
    prov = yaml.safe_load(out.read_text())["calibration"]["handoff"]
    assert prov["through"] == url and prov["holdout_points"] >= 1
    # priced with the hand-off, the held-out first tokens are far closer than without it
    assert prov["ttft_holdout_mape"] < 0.25 < prov["ttft_holdout_mape_without_handoff"]
