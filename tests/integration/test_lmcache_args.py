"""``launch.kv_tier: lmcache``: SGLang's own parser and resolution accept every LMCache argument
list the launcher builds, and refuse LMCache with HiCache and with PD disaggregation exactly as
the launcher does (which refuses them first, with the config key to change).

SGLang runs in its own interpreter (tests/sglang_cpu/_locate.py); ``resolve_once`` (SGLang's
start-up resolution, where the cross-flag refusals live) reads the model's config, so those
cases run on a tiny local Llama built by tests/sglang_cpu/build_tiny_llama.py (no hub).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stack.launch import lmcache_tier
from stack.launch.k8s import render_k8s
from stack.launch.sglang import resolved_config, sglang_argvs, sglang_process_specs
from stack.launch.sglang_config import LaunchConfigError
from stack.paths import configs_dir

HERE = Path(__file__).resolve().parents[1]  # tests/
sys.path.insert(0, str(HERE / "sglang_cpu"))
from _locate import sglang_python, skip_or_fail, skip_reason  # noqa: E402

PARSER = HERE / "sglang_cpu" / "parse_server_args.py"
SHIM = HERE / "sglang_cpu" / "shim"
H200 = configs_dir() / "qwen3-coder-30b-h200-lmcache.yaml"


def cpu_lmcache_config(model_path: str, run_dir: str = "/tmp/smetric-lmcache-run") -> dict:
    """One colocated CPU worker with LMCache as its KV tier."""
    return {
        "model": {"name": "tiny", "path": model_path, "page_size": 16, "context_length": 4096},
        "router": {"port": 18000},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "run_dir": run_dir,
            "kv_tier": "lmcache",
            "nodes": [{"name": "local", "host": "127.0.0.1", "gpus": 0}],
            "prefill": {"count": 1, "port": 18100, "disaggregation": False, "kv_events_port": None},
            "decode": {"count": 0},
            "lmcache": {
                "server": {"port": 18556, "http_port": 18088, "l1_size_gb": 1},
                "controller": {"port": 18900, "pull_port": 18300, "reply_port": 18400},
            },
            "mooncake_master": {"rpc_port": 18051, "http_metadata_port": 18080, "metrics_port": 18003},
            "mooncake_store": {"global_segment_size": "1gb"},
        },
    }


def _run_parser(items: list, env: dict | None = None) -> dict:
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    r = subprocess.run(
        [py, str(PARSER)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, f"parser helper failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    py = sglang_python()
    if py is None:
        skip_or_fail(skip_reason())
    out = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run(
        [py, str(HERE / "sglang_cpu" / "build_tiny_llama.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return str(out)


def _h200() -> dict:
    return yaml.safe_load(H200.read_text())


def test_h200_lmcache_deployment_processes():
    specs = sglang_process_specs(_h200())
    roles = [s.role for s in specs]
    assert roles.count("lmcache_server") == 2 and roles.count("lmcache_controller") == 1
    assert roles.count("prefill") == 16 and "decode" not in roles
    # servers come before the workers that dial them, and a server per worker node
    first_worker = roles.index("prefill")
    assert all(i < first_worker for i, r in enumerate(roles) if r.startswith("lmcache"))
    servers = {s.node: s for s in specs if s.role == "lmcache_server"}
    assert set(servers) == {"h200-a", "h200-b"}
    l2 = json.loads(servers["h200-b"].argv[servers["h200-b"].argv.index("--l2-adapter") + 1])
    assert l2["type"] == "mooncake_store" and l2["master_server_addr"] == "10.0.0.1:50051"
    assert l2["local_hostname"] == "10.0.0.2" and l2["protocol"] == "rdma"
    for w in (s for s in specs if s.role == "prefill"):
        path = w.argv[w.argv.index("--lmcache-config-file") + 1]
        assert path == f"/var/run/smetric/lmcache-{w.node}.yaml"
        text = yaml.safe_load(w.files[path])
        assert text == {"mp_host": w.host, "mp_port": 5556}
        assert "--enable-hierarchical-cache" not in w.argv and "--disaggregation-mode" not in w.argv
    rc = resolved_config(_h200())["router"]
    assert rc["global_tier"] == "lmcache" and rc["lmcache_controller_url"] == "http://10.0.0.1:9000"


def test_launcher_refuses_what_sglang_refuses():
    cfg = cpu_lmcache_config("/m")
    hc = copy.deepcopy(cfg)
    hc["launch"]["prefill"]["hicache"] = {"ratio": 2}
    with pytest.raises(LaunchConfigError, match="mutually exclusive"):
        sglang_process_specs(hc)
    pd = copy.deepcopy(cfg)
    pd["launch"]["prefill"]["disaggregation"] = True
    pd["launch"]["decode"] = {"count": 1}
    with pytest.raises(LaunchConfigError, match="colocated"):
        sglang_process_specs(pd)
    bad = copy.deepcopy(cfg)
    bad["launch"]["kv_tier"] = "lmcash"
    with pytest.raises(LaunchConfigError, match="kv_tier"):
        sglang_process_specs(bad)
    seg = copy.deepcopy(cfg)
    seg["launch"]["mooncake_store"] = {"global_segment_size": "256mb"}
    with pytest.raises(LaunchConfigError, match="global_segment_size"):
        sglang_process_specs(seg)
    no_master = copy.deepcopy(cfg)
    no_master["launch"]["mooncake_master"] = None
    with pytest.raises(LaunchConfigError, match="mooncake"):
        sglang_process_specs(no_master)
    no_master["launch"]["lmcache"]["server"]["l2"] = "none"
    assert (
        "--l2-adapter"
        not in next(s for s in sglang_process_specs(no_master) if s.role == "lmcache_server").argv
    )


def test_every_lmcache_argv_parses():
    items = [(f"h200:{n}", a) for n, a in sglang_argvs(_h200())]
    for text in render_k8s(_h200()).values():
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "StatefulSet":
                c = next(c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang")
                items.append((f"h200:k8s:{doc['metadata']['name']}", [*c["command"], *c["args"]]))
    res = _run_parser(items)
    bad = {k: v["error"] for k, v in res.items() if not v["ok"]}
    assert not bad, bad
    assert len(res) == 17
    for v in res.values():
        assert v["fields"]["enable_lmcache"] is True and v["fields"]["enable_hierarchical_cache"] is False
        assert v["fields"]["disaggregation_mode"] == "null"
    assert res["h200:k8s:prefill"]["fields"]["lmcache_config_file"] == "/etc/smetric/lmcache-prefill-pod.yaml"


def test_sglang_resolution_accepts_lmcache_and_refuses_it_with_hicache_or_pd(tiny_model, tmp_path):
    cfg = cpu_lmcache_config(tiny_model, str(tmp_path / "run"))
    [(name, argv)] = sglang_argvs(cfg)
    res = _run_parser(
        [
            ("lmcache", argv, {"resolve": True}),
            ("lmcache+hicache", [*argv, "--enable-hierarchical-cache"], {"resolve": True}),
            ("lmcache+pd", [*argv, "--disaggregation-mode", "prefill"], {"resolve": True}),
        ],
        env={"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(SHIM)},
    )
    assert res["lmcache"]["ok"], res["lmcache"]
    assert res["lmcache"]["fields"]["lmcache_config_file"] == lmcache_tier.config_file_path(
        cfg["launch"], "local"
    )
    assert not res["lmcache+hicache"]["ok"]
    assert (
        "--enable-lmcache and --enable-hierarchical-cache are mutually exclusive"
        in res["lmcache+hicache"]["error"]
    )
    assert not res["lmcache+pd"]["ok"]
    assert "colocated prefill/decode scheduling only" in res["lmcache+pd"]["error"]
