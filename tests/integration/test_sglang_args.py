"""Every SGLang argument list we generate must parse with SGLang's own parser.

`prepare_server_args` (what `python -m sglang.launch_server` calls) runs argparse with
SGLang's real flag table and then ServerArgs' own validation, so a typo, a removed option or
a bad choice fails here. sglang runs in its own interpreter (`.ci/install-sglang.sh` puts it
in /opt/sglang-venv; `$SMETRIC_SGLANG_PYTHON` overrides); when none has sglang these tests
skip with the reason (under CI=true they fail instead).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stack.launch.k8s import render_k8s
from stack.launch.sglang import sglang_argvs
from stack.paths import configs_dir

HERE = Path(__file__).resolve().parents[1]  # tests/
sys.path.insert(0, str(HERE / "sglang_cpu"))
from _locate import sglang_python, skip_or_fail, skip_reason  # noqa: E402

PARSER = HERE / "sglang_cpu" / "parse_server_args.py"


def _sglang_configs() -> list[Path]:
    out = []
    for p in sorted(configs_dir().glob("*.yaml")):
        data = yaml.safe_load(p.read_text()) or {}
        if isinstance(data, dict) and (data.get("launch") or {}).get("engine") == "sglang":
            out.append(p)
    return out


def cpu_tier_config(model_path: str = "/tmp/tiny-llama") -> dict:
    """The shape the CPU tier launches (device cpu, mooncake_tcp, KV events, HiCache on P)."""
    return {
        "model": {"name": "tiny", "path": model_path, "page_size": 16, "context_length": 4096},
        "router": {"port": 18000},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {
                "count": 1,
                "port": 18100,
                "bootstrap_port": 18998,
                "kv_events_port": 18557,
                "transfer_backend": "mooncake_tcp",
                "hicache": {"ratio": 2, "storage_backend": "mooncake"},
            },
            "decode": {"count": 1, "port": 18200, "transfer_backend": "mooncake_tcp"},
            "mooncake_master": {"rpc_port": 18051, "http_metadata_port": 18080, "metrics_port": 18003},
        },
    }


def _parse(items: list[tuple[str, list[str]]]) -> dict:
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    r = subprocess.run(
        [py, str(PARSER)], input=json.dumps(items), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"parser helper failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def _all_items() -> list[tuple[str, list[str]]]:
    items = []
    for p in _sglang_configs():
        data = yaml.safe_load(p.read_text())
        items += [(f"{p.name}:{name}", argv) for name, argv in sglang_argvs(data)]
        # the Kubernetes StatefulSets' container commands, too
        for text in render_k8s(data).values():
            for doc in yaml.safe_load_all(text):
                if doc and doc["kind"] == "StatefulSet":
                    c = doc["spec"]["template"]["spec"]["containers"][0]
                    items.append((f"{p.name}:k8s:{doc['metadata']['name']}", [*c["command"], *c["args"]]))
    items += [(f"cpu-tier:{name}", argv) for name, argv in sglang_argvs(cpu_tier_config())]
    items += [(f"priority:{name}", argv) for name, argv in sglang_argvs(priority_config())]
    lof = priority_config()
    lof["launch"]["prefill"]["extra_args"] = ["--schedule-policy", "lof"]
    items += [(f"priority-lof:{name}", argv) for name, argv in sglang_argvs(lof)]
    items += [(f"keys:{name}", argv) for name, argv in sglang_argvs(keys_config())]
    return items


def keys_config() -> dict:
    """The CPU tier's shape with the workers' API and admin keys (launch.sglang.*_env)."""
    cfg = cpu_tier_config()
    cfg["launch"]["sglang"] = {
        "api_key_env": "SMETRIC_WORKER_API_KEY",
        "admin_api_key_env": "SMETRIC_WORKER_ADMIN_KEY",
    }
    return cfg


def priority_config() -> dict:
    """The CPU tier's shape with launch.sglang.priority_scheduling on."""
    cfg = cpu_tier_config()
    cfg["launch"]["sglang"] = {"priority_scheduling": True}
    return cfg


def test_shipped_configs_exist():
    names = {p.name for p in _sglang_configs()}
    assert {"qwen3-coder-30b-h20-32p.yaml", "qwen3-coder-30b-h200-1node.yaml"} <= names


@pytest.fixture(scope="module")
def parsed() -> dict:
    return _parse(_all_items())


def test_every_generated_argv_parses(parsed):
    bad = {k: v["error"] for k, v in parsed.items() if not v["ok"]}
    assert not bad, "SGLang rejected generated arguments:\n" + "\n".join(f"{k}: {e}" for k, e in bad.items())
    assert len(parsed) == len(_all_items())


def test_parsed_values_are_what_we_meant(parsed):
    p0 = parsed["qwen3-coder-30b-h20-32p.yaml:prefill-0"]["fields"]
    assert p0["disaggregation_mode"] == "prefill"
    assert p0["disaggregation_transfer_backend"] == "mooncake"
    assert p0["disaggregation_bootstrap_port"] == 8998
    assert p0["disaggregation_ib_device"] == "mlx5_0"
    assert p0["enable_hierarchical_cache"] is True
    assert p0["hicache_storage_backend"] == "mooncake"
    assert p0["page_size"] == 64 and p0["tp_size"] == 1 and p0["enable_metrics"] is True
    assert json.loads(p0["kv_events_config"])["endpoint"] == "tcp://*:5557"
    d0 = parsed["qwen3-coder-30b-h20-32p.yaml:decode-0"]["fields"]
    assert d0["disaggregation_mode"] == "decode" and d0["tp_size"] == 2
    assert json.loads(d0["disaggregation_ib_device"]) == {"0": "mlx5_0", "1": "mlx5_1"}
    c = parsed["cpu-tier:prefill-0"]["fields"]
    assert c["device"] == "cpu" and c["disaggregation_transfer_backend"] == "mooncake_tcp"
    assert c["hicache_io_backend"] == "direct"


def test_parser_is_strict():
    """Negative control: a typo'd flag and a bad choice are rejected by the same path."""
    base = ["python3", "-m", "sglang.launch_server", "--model-path", "/m"]
    res = _parse(
        [
            ("typo", [*base, "--disagregation-mode", "prefill"]),
            ("choice", [*base, "--disaggregation-transfer-backend", "carrier-pigeon"]),
            ("good", [*base, "--disaggregation-mode", "prefill"]),
        ]
    )
    assert not res["typo"]["ok"] and not res["choice"]["ok"]
    assert res["good"]["ok"], res["good"]


def test_priority_scheduling_flags_parse(parsed):
    for role in ("prefill", "decode"):
        f = parsed[f"priority:{role}-0"]["fields"]
        assert f["enable_priority_scheduling"] is True and f["disable_priority_preemption"] is True
        assert f["schedule_policy"] == "fcfs" and f["schedule_low_priority_values_first"] is False
        assert parsed[f"cpu-tier:{role}-0"]["fields"]["enable_priority_scheduling"] is False
    assert parsed["priority-lof:prefill-0"]["fields"]["schedule_policy"] == "lof"


def test_worker_key_flags_parse(parsed):
    """The keys travel as $(NAME) (the launcher or Kubernetes substitutes the secret): SGLang's
    parser takes both flags, and the router's config names the same env vars."""
    from stack.launch.sglang import resolved_config

    for role in ("prefill", "decode"):
        f = parsed[f"keys:{role}-0"]["fields"]
        assert f["api_key"] == "$(SMETRIC_WORKER_API_KEY)"
        assert f["admin_api_key"] == "$(SMETRIC_WORKER_ADMIN_KEY)"
        assert parsed[f"cpu-tier:{role}-0"]["fields"]["api_key"] is None
    auth = resolved_config(keys_config())["router"]["auth"]
    assert auth == {
        "worker_api_key_env": "SMETRIC_WORKER_API_KEY",
        "worker_admin_api_key_env": "SMETRIC_WORKER_ADMIN_KEY",
    }
