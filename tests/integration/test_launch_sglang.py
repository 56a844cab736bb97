"""stack.launch.sglang / stack.launch.k8s: placement, commands, dry run, manifests (no sglang needed)."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import yaml

from stack.config import parse_config
from stack.launch.k8s import k8s_router_config, render_k8s, write_k8s
from stack.launch.sglang import (
    LaunchConfigError,
    dry_run_text,
    load_yaml,
    pools,
    resolved_config,
    sglang_process_specs,
)
from stack.paths import configs_dir

H20 = configs_dir() / "qwen3-coder-30b-h20-32p.yaml"
H200 = configs_dir() / "qwen3-coder-30b-h200-1node.yaml"


@pytest.fixture(scope="module")
def h20() -> dict:
    return load_yaml(H20)


@pytest.fixture(scope="module")
def h200() -> dict:
    return load_yaml(H200)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# --- placement --------------------------------------------------------------------------------


def test_h20_split_is_32_prefill_on_four_nodes_plus_decode_node(h20):
    specs = sglang_process_specs(h20)
    roles = Counter(s.role for s in specs)
    assert roles == {"prefill": 32, "decode": 4, "mooncake_master": 1, "redis": 1, "router": 1}
    per_node = Counter((s.node, s.role) for s in specs if s.role in ("prefill", "decode"))
    for n in ("h20-p0", "h20-p1", "h20-p2", "h20-p3"):
        assert per_node[(n, "prefill")] == 8
    assert per_node[("h20-d0", "decode")] == 4
    # every GPU of every node used exactly once
    for node in ("h20-p0", "h20-p1", "h20-p2", "h20-p3", "h20-d0"):
        gpus = sorted(g for s in specs if s.node == node for g in s.gpus)
        assert gpus == list(range(8)), (node, gpus)
    d = [s for s in specs if s.role == "decode"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in d] == ["0,1", "2,3", "4,5", "6,7"]
    assert json.loads(_flag(d[1].argv, "--disaggregation-ib-device")) == {"0": "mlx5_2", "1": "mlx5_3"}
    assert d[1].env.get("MOONCAKE_DEVICE") is None  # decode has no HiCache -> no store env


def test_h200_one_node_uses_each_gpu_once(h200):
    specs = sglang_process_specs(h200)
    assert Counter(s.role for s in specs) == {"prefill": 6, "decode": 2, "mooncake_master": 1, "router": 1}
    assert sorted(g for s in specs for g in s.gpus) == list(range(8))
    assert {s.node for s in specs} == {"h200-0"}


def test_ports_unique_per_node(h20):
    seen = set()
    for p in pools(h20):
        for key in ("port", "bootstrap_port", "kv_events_port"):
            if key in p:
                assert (p["node"], p[key]) not in seen
                seen.add((p["node"], p[key]))


# --- commands and environment ------------------------------------------------------------------


def test_prefill_command_has_every_required_flag(h20):
    p = next(s for s in sglang_process_specs(h20) if s.name == "prefill-9")
    a = p.argv
    assert a[:3] == ["python3", "-m", "sglang.launch_server"]
    assert p.node == "h20-p1" and p.gpus == [1] and p.host == "10.0.0.11"
    assert _flag(a, "--disaggregation-mode") == "prefill"
    assert _flag(a, "--disaggregation-transfer-backend") == "mooncake"
    assert _flag(a, "--disaggregation-bootstrap-port") == "9008"
    assert _flag(a, "--disaggregation-ib-device") == "mlx5_1"
    assert "--enable-hierarchical-cache" in a and _flag(a, "--hicache-storage-backend") == "mooncake"
    assert json.loads(_flag(a, "--kv-events-config")) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5567",
        "topic": "kv",
        "replay_endpoint": "tcp://*:5568",  # the port after the events' (SGLang's convention)
    }
    assert "--enable-metrics" in a
    assert _flag(a, "--page-size") == "64" and _flag(a, "--tp-size") == "1"
    assert (
        _flag(a, "--chunked-prefill-size") == "8192" and _flag(a, "--mem-fraction-static") == "0.88"
    )  # h20.yaml's chunk
    assert _flag(a, "--port") == "30010" and _flag(a, "--host") == "0.0.0.0"
    e = p.env
    assert e["CUDA_VISIBLE_DEVICES"] == "1"
    assert e["MOONCAKE_MASTER"] == "10.0.0.10:50051"
    assert e["MOONCAKE_PROTOCOL"] == "rdma" and e["MOONCAKE_DEVICE"] == "mlx5_1"
    assert e["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "64gb"
    assert e["SGLANG_HOST_IP"] == "10.0.0.11" and e["MOONCAKE_LOCAL_HOSTNAME"] == "10.0.0.11"
    assert p.ready_url == "http://10.0.0.11:30010/health"


def test_infra_and_router_commands(h20):
    specs = {s.name: s for s in sglang_process_specs(h20)}
    m = specs["mooncake-master"]
    assert m.argv[0] == "mooncake_master" and "--rpc_port=50051" in m.argv and m.node == "h20-p0"
    assert specs["redis"].argv[:3] == ["redis-server", "--port", "6379"]
    r = specs["router"]
    assert r.argv == ["smetric", "router", "--config", "/var/run/smetric/router-config.yaml"]
    assert r.ready_url == "http://10.0.0.10:8000/health"
    order = [s.role for s in sglang_process_specs(h20)]
    assert order.index("mooncake_master") < order.index("prefill") < order.index("router")


def test_cpu_device_flags_and_env():
    cfg = {
        "model": {"path": "/tmp/m", "page_size": 16},
        "launch": {
            "engine": "sglang",
            "device": "cpu",
            "prefill": {"count": 2, "transfer_backend": "mooncake_tcp"},
            "decode": {"count": 1, "transfer_backend": "mooncake_tcp"},
            "router": False,
        },
    }
    specs = sglang_process_specs(cfg)
    assert [s.role for s in specs] == ["prefill", "prefill", "decode"]
    for s in specs:
        assert "CUDA_VISIBLE_DEVICES" not in s.env and s.gpus == []
        assert s.env["SGLANG_USE_CPU_ENGINE"] == "1" and s.env["HF_HUB_OFFLINE"] == "1"
        assert _flag(s.argv, "--device") == "cpu" and "--disable-cuda-graph" in s.argv
        assert _flag(s.argv, "--max-total-tokens") == "16384"
        assert _flag(s.argv, "--host") == "127.0.0.1"
        assert "--disaggregation-ib-device" not in s.argv
    p, d = specs[0], specs[2]
    assert p.env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] == "1"
    assert p.env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] == "0"
    assert _flag(d.argv, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert specs[1].argv[specs[1].argv.index("--port") + 1] == "30010"


# --- resolved router config --------------------------------------------------------------------


def test_resolved_config_is_a_valid_router_config(h20):
    rc = resolved_config(h20)
    dc = parse_config(rc)
    assert len(dc.prefill) == 32 and len(dc.decode) == 4
    p9 = dc.prefill[9]
    assert p9.url == "http://10.0.0.11:30010" and p9.bootstrap_port == 9008
    assert p9.kv_events == "tcp://10.0.0.11:5567"
    assert dc.decode[0].url == "http://10.0.0.20:31000"
    assert dc.mooncake and dc.mooncake.master == "10.0.0.10:50051"
    assert rc["router"]["redis_url"] == "redis://10.0.0.10:6379/0"


def test_top_level_worker_lists_conflict(h20):
    bad = copy.deepcopy(h20)
    bad["prefill"] = [{"url": "http://x:1"}]
    with pytest.raises(LaunchConfigError, match="derived"):
        resolved_config(bad)


# --- dry run -----------------------------------------------------------------------------------


def test_dry_run_lists_every_command_per_node(h20):
    text = dry_run_text(h20)
    for n in ("h20-p0", "h20-p1", "h20-p2", "h20-p3", "h20-d0"):
        assert f"## node {n} " in text
    assert text.count("-m sglang.launch_server") == 36
    assert text.count("CUDA_VISIBLE_DEVICES=") == 36
    assert "mooncake_master" in text and "redis-server" in text and "smetric router" in text
    assert "--config /var/run/smetric/router-config.yaml" in text
    # the node sections split the processes: p1 has 8 prefill, d0 has the 4 decode
    sections = text.split("## node ")
    p1 = next(s for s in sections if s.startswith("h20-p1"))
    d0 = next(s for s in sections if s.startswith("h20-d0"))
    assert p1.count("--disaggregation-mode prefill") == 8 and "decode" not in p1.replace(
        "--disaggregation-mode prefill", ""
    )
    assert d0.count("--disaggregation-mode decode") == 4
    # the router config written on the router's node parses as a router config
    body = text.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    assert len(parse_config(yaml.safe_load(body)).prefill) == 32


def test_dry_run_is_pasteable_shell(h200):
    import shlex

    text = dry_run_text(h200)
    cmds = [c for c in text.split("\n\n") if "sglang.launch_server" in c]
    assert len(cmds) == 8
    for c in cmds:
        lines = [ln for ln in c.splitlines() if not ln.startswith("#")]
        words = shlex.split(" ".join(ln.rstrip("\\").rstrip(" &") for ln in lines))
        assert words[0] == "env" and "--kv-events-config" in words or "--disaggregation-mode" in words


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c["launch"]["prefill"].__setitem__("count", 33), "do not fit"),
        (lambda c: c["launch"]["decode"].__setitem__("nodes", ["nope"]), "unknown node"),
        (lambda c: c["launch"]["mooncake_store"].__setitem__("global_segment_size", "256mb"), "gb"),
        (lambda c: c["launch"].__setitem__("engine", "emulate"), "engine"),
        (lambda c: c["launch"]["prefill"].__setitem__("tp", 0), "tp"),
    ],
)
def test_bad_configs_fail_with_a_reason(h20, mutate, match):
    c = copy.deepcopy(h20)
    mutate(c)
    with pytest.raises(LaunchConfigError, match=match):
        sglang_process_specs(c)


def test_module_cli_prints_dry_run(capsys):
    from stack.launch.dry_run import main

    assert main([str(H200)]) == 0
    assert "## node h200-0" in capsys.readouterr().out


# --- Kubernetes --------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_match_the_config(h20, tmp_path):
    files = render_k8s(h20)
    docs = {n: [d for d in yaml.safe_load_all(t) if d] for n, t in files.items()}
    kinds = Counter(d["kind"] for ds in docs.values() for d in ds)
    assert kinds == {
        "Namespace": 1,
        "ConfigMap": 1,
        "Service": 6,  # + smetric-router-pods, the headless one Prometheus finds replicas by
        "Deployment": 3,
        "StatefulSet": 2,
        "PodDisruptionBudget": 3,  # router, prefill, decode
    }
    sts = {d["metadata"]["name"]: d for ds in docs.values() for d in ds if d["kind"] == "StatefulSet"}
    assert sts["prefill"]["spec"]["replicas"] == 32 and sts["decode"]["spec"]["replicas"] == 4
    pc = sts["prefill"]["spec"]["template"]["spec"]["containers"][0]
    dc = sts["decode"]["spec"]["template"]["spec"]["containers"][0]
    assert (
        pc["resources"]["limits"]["nvidia.com/gpu"] == 1 and dc["resources"]["limits"]["nvidia.com/gpu"] == 2
    )
    args = pc["args"]
    assert _flag(args, "--disaggregation-mode") == "prefill" and _flag(args, "--host") == "0.0.0.0"
    env = {e["name"]: e for e in pc["env"]}
    assert env["SGLANG_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["MOONCAKE_MASTER"]["value"] == "mooncake-master.smetric.svc.cluster.local:50051"
    assert "CUDA_VISIBLE_DEVICES" not in env
    cm = docs["10-config.yaml"][0]
    rc = parse_config(yaml.safe_load(cm["data"]["router-config.yaml"]))
    assert (
        len(rc.prefill) == 32
        and rc.prefill[31].url == "http://prefill-31.prefill.smetric.svc.cluster.local:30000"
    )
    assert rc.prefill[0].kv_events == "tcp://prefill-0.prefill.smetric.svc.cluster.local:5557"
    assert k8s_router_config(h20)["decode"][3]["url"].startswith("http://decode-3.decode.")
    paths = write_k8s(h20, tmp_path / "k8s")
    assert sorted(p.name for p in paths) == sorted([*files, "create-secrets.sh"])


def test_k8s_host_network_needs_whole_node_pods(h20):
    c = copy.deepcopy(h20)
    c["launch"]["k8s"]["host_network"] = True
    with pytest.raises(LaunchConfigError, match="host_network"):
        render_k8s(c)


def test_k8s_h200(h200):
    files = render_k8s(h200)
    assert "21-redis.yaml" not in files
    docs = [d for t in files.values() for d in yaml.safe_load_all(t) if d]
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ConfigMap",
        "Service",
        "Deployment",
        "StatefulSet",
        "PodDisruptionBudget",
    }


def test_external_mooncake_master_is_not_launched(h200):
    c = copy.deepcopy(h200)
    del c["launch"]["mooncake_master"]
    c["mooncake"] = {"master": "10.1.1.1:50051"}
    specs = sglang_process_specs(c)
    assert "mooncake_master" not in {s.role for s in specs}
    assert {s.env["MOONCAKE_MASTER"] for s in specs if s.role == "prefill"} == {"10.1.1.1:50051"}
    assert resolved_config(c)["mooncake"]["master"] == "10.1.1.1:50051"


def test_smetric_up_dry_run_prints_the_sglang_commands(capsys):
    from stack.cli import main

    assert main(["up", "--config", str(H200), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("-m sglang.launch_server") == 8 and "## node h200-0" in out


def _prio_cfg(**launch) -> dict:
    from test_sglang_args import cpu_tier_config

    cfg = cpu_tier_config()
    cfg["launch"]["sglang"] = {"priority_scheduling": True}
    cfg["launch"].update(launch)
    return cfg


def test_priority_scheduling_flags_and_env():
    specs = {s.name: s for s in sglang_process_specs(_prio_cfg())}
    for name in ("prefill-0", "decode-0"):
        a = specs[name].argv
        assert "--enable-priority-scheduling" in a and "--disable-priority-preemption" in a
        assert a[a.index("--schedule-policy") + 1] == "fcfs"
        assert specs[name].env["SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES"] == "1"
    off = {s.name: s for s in sglang_process_specs(_prio_cfg(sglang={}))}
    assert "--enable-priority-scheduling" not in off["prefill-0"].argv
    assert "--schedule-policy" not in off["prefill-0"].argv
    assert "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES" not in off["prefill-0"].env


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--schedule-policy", "lpm"], "--schedule-policy lpm"),
        (["--schedule-policy=dfs-weight"], "--schedule-policy dfs-weight"),
        (["--schedule-low-priority-values-first"], "low-priority-values-first"),
    ],
)
def test_priority_scheduling_refuses_a_conflicting_policy(extra, msg):
    with pytest.raises(LaunchConfigError, match=msg):
        sglang_process_specs(_prio_cfg(extra_args=extra))


def test_priority_scheduling_must_be_a_bool():
    with pytest.raises(LaunchConfigError, match="priority_scheduling"):
        sglang_process_specs(_prio_cfg(sglang={"priority_scheduling": "yes"}))
