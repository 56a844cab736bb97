"""The Kubernetes manifests `smetric up --config X --k8s DIR` writes (stack/launch/k8s.py), held
to Kubernetes' own schemas and to what running them needs.

Every document of every shipped GPU config, and of variants with client keys, Redis over TLS, an
RDMA device plugin and LMCache, validates against the OpenAPI schemas of Kubernetes 1.30 and 1.37
in strict mode (unknown fields refused) with kubernetes-validate, which bundles them: no cluster,
no network. Then: probes have timeouts that fit SGLang's /health (never under 1 s, its own 503
after 20 s), every container requests CPU and memory, the router has a PodDisruptionBudget and a
preStop, client keys, the admin token, the Redis password and the workers' keys come from Secrets
that create-secrets.sh makes (run here against a kubectl that records what it is asked), and
the retired `launch.k8s.ib_devices` is refused with a reason."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from stack.config import parse_config
from stack.launch import replicas
from stack.launch.k8s import KEYS_MOUNT, render_k8s, secret_keys, write_k8s
from stack.launch.sglang_config import LaunchConfigError
from stack.paths import configs_dir

VERSIONS = ("1.30.0", "1.37.0")
GPU_CONFIGS = sorted(p.name for p in configs_dir().glob("qwen3-coder-30b-*.yaml"))


def _cfg(name: str) -> dict:
    cfg = yaml.safe_load((configs_dir() / name).read_text())
    replicas.ensure_redis(cfg)  # as `smetric up` does: replicas > 1 get a Redis
    return cfg


def _operated(name: str) -> dict:
    """``name`` as an operator would run it: client keys, workers' keys, Redis over TLS, RDMA."""
    cfg = _cfg(name)
    cfg["router"]["auth"] = {"keys_file": "/etc/keys.yaml"}
    cfg["launch"].setdefault("sglang", {}).update(
        api_key_env="SMETRIC_WORKER_API_KEY", admin_api_key_env="SMETRIC_WORKER_ADMIN_KEY"
    )
    cfg["launch"]["redis"] = {**(cfg["launch"].get("redis") or {"port": 6379}), "tls": {
        "cert_file": "/x/tls.crt", "key_file": "/x/tls.key", "ca_file": "/x/ca.crt"}}  # fmt: skip
    cfg["launch"]["k8s"] = {**cfg["launch"].get("k8s", {}), "rdma_resource": "rdma/hca"}
    return cfg


def _docs(cfg: dict) -> list[dict]:
    return [d for text in render_k8s(cfg).values() for d in yaml.safe_load_all(text) if d]


def _pods(docs: list[dict]) -> dict[str, dict]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }


CASES = [(n, False) for n in GPU_CONFIGS] + [(n, True) for n in GPU_CONFIGS]


@pytest.mark.parametrize("name, operated", CASES, ids=[f"{n}{'+ops' if o else ''}" for n, o in CASES])
def test_every_manifest_passes_the_kubernetes_schemas(name, operated):
    docs = _docs(_operated(name) if operated else _cfg(name))
    assert docs
    for doc in docs:
        for v in VERSIONS:
            kubernetes_validate.validate(doc, v, strict=True)


def test_the_schema_check_bites():
    docs = _docs(_cfg("qwen3-coder-30b-h20-32p.yaml"))
    sts = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["timeoutSeconds"] = "5s"
    with pytest.raises(kubernetes_validate.ValidationError, match="not of type 'integer'"):
        kubernetes_validate.validate(sts, VERSIONS[0], strict=True)
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {"timeout": 5}
    with pytest.raises(kubernetes_validate.ValidationError, match="'timeout' was unexpected"):
        kubernetes_validate.validate(sts, VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_probes_fit_sglang_health_and_every_container_requests_resources(name):
    for pod_name, pod in _pods(_docs(_operated(name))).items():
        for c in pod["containers"]:
            where = f"{pod_name}/{c['name']}"
            req = c["resources"]["requests"]
            assert req["cpu"] and req["memory"], where
            assert "readinessProbe" in c, where
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c:
                    assert c[kind]["timeoutSeconds"] >= 2, (where, kind)
            if c["name"] == "sglang":  # SGLang's /health: >= 1 s always, its own 503 after 20 s
                assert c["readinessProbe"]["timeoutSeconds"] >= 5 and c["startupProbe"]["timeoutSeconds"] >= 5
                assert c["livenessProbe"]["timeoutSeconds"] > 20, where
                start = c["startupProbe"]
                assert start["periodSeconds"] * start["failureThreshold"] >= 900, where  # the weights' load
                assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_worker_memory_request_counts_the_mooncake_segment():
    docs = _docs(_cfg("qwen3-coder-30b-h20-32p.yaml"))
    c = _pods(docs)["prefill"]["containers"][0]
    seg = next(e["value"] for e in c["env"] if e["name"] == "MOONCAKE_GLOBAL_SEGMENT_SIZE")
    assert seg == "64gb" and c["resources"]["requests"]["memory"] == "80Gi"  # 16 per GPU + 64
    cfg = _cfg("qwen3-coder-30b-h20-32p.yaml")
    cfg["launch"]["k8s"]["resources"] = {"prefill": {"requests": {"cpu": "12", "memory": "900Gi"}}}
    c = _pods(_docs(cfg))["prefill"]["containers"][0]
    assert c["resources"]["requests"] == {"cpu": "12", "memory": "900Gi"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # the GPU stays


def test_router_has_a_disruption_budget_a_prestop_and_a_pod_service_for_prometheus():
    docs = _docs(_cfg("qwen3-coder-30b-h200-2node.yaml"))
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert pdbs["smetric-router"]["maxUnavailable"] == 1
    assert pdbs["smetric-router"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "smetric-router")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) < pod["terminationGracePeriodSeconds"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"  # not /health: 503 without workers
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "smetric-router-pods")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["name"] == "http"


def test_keys_come_from_secrets_and_create_secrets_makes_every_one(tmp_path):
    cfg = _operated("qwen3-coder-30b-h200-2node.yaml")
    docs = _docs(cfg)
    pods = _pods(docs)
    r = pods["smetric-router"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in r["env"] if "valueFrom" in e}
    assert env["SMETRIC_ADMIN_TOKEN"] == {
        "name": "smetric-keys",
        "key": "SMETRIC_ADMIN_TOKEN",
        "optional": True,
    }
    assert env["SMETRIC_REDIS_PASSWORD"]["name"] == "smetric-keys"
    assert {"SMETRIC_WORKER_API_KEY", "SMETRIC_WORKER_ADMIN_KEY"} <= set(env)
    vols = {v["name"]: v for v in pods["smetric-router"]["volumes"]}
    assert vols["client-keys"]["secret"]["secretName"] == "smetric-client-keys"
    assert vols["redis-tls"]["secret"]["secretName"] == "smetric-redis-tls"
    redis = pods["redis"]["containers"][0]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(SMETRIC_REDIS_PASSWORD)"
    assert "--tls-port" in redis["args"]
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "smetric-router-config"
    )
    rc = parse_config(yaml.safe_load(cm["data"]["router-config.yaml"])).router
    assert rc.auth.keys_file == f"{KEYS_MOUNT}/keys.yaml" and rc.auth.keys_env is None
    assert rc.redis_password_env == "SMETRIC_REDIS_PASSWORD"
    assert rc.redis_url.startswith("rediss://redis.smetric.svc.cluster.local:")
    # create-secrets.sh, against a kubectl that records each call and knows no Secret yet
    paths = write_k8s(cfg, tmp_path / "k8s")
    script = next(p for p in paths if p.name == "create-secrets.sh")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "kubectl.log"
    record = f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n'
    (bin_ / "kubectl").write_text(record + 'case "$*" in *" get "*) exit 1;; esac\n')
    (bin_ / "kubectl").chmod(0o755)
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [{name: a, sha256: " + "0" * 64 + "}]\n")
    env_run = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "KEYS_FILE": str(keys),
               "REDIS_TLS_CERT": "/c", "REDIS_TLS_KEY": "/k", "REDIS_TLS_CA": "/ca",
               "SMETRIC_ADMIN_TOKEN": "admin-from-env"}  # fmt: skip
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env_run, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "admin-from-env" not in out.stdout + out.stderr  # nothing printed
    calls = log.read_text().splitlines()
    creates = {c.split()[5]: c for c in calls if c.startswith("-n smetric create secret generic")}
    for secret, ks in secret_keys(cfg).items():
        assert secret in creates, (secret, calls)
        for k in filter(None, ks):
            assert f"--from-literal={k}=" in creates[secret], (secret, k)
    assert "--from-literal=SMETRIC_ADMIN_TOKEN=admin-from-env" in creates["smetric-keys"]
    assert f"--from-file=keys.yaml={keys}" in creates["smetric-client-keys"]
    for name in ("tls.crt", "tls.key", "ca.crt"):
        assert f"--from-file={name}=" in creates["smetric-redis-tls"]
    # an existing Secret is kept: a second run against a cluster that has them creates none
    (bin_ / "kubectl").write_text(record + "exit 0\n")
    log.write_text("")
    assert subprocess.run(["bash", str(script)], env=env_run, capture_output=True, timeout=60).returncode == 0
    assert not [c for c in log.read_text().splitlines() if " create secret " in c]


def test_rdma_is_one_device_per_gpu_and_ib_devices_is_refused():
    cfg = _operated("qwen3-coder-30b-h20-32p.yaml")
    pods = _pods(_docs(cfg))
    assert pods["prefill"]["containers"][0]["resources"]["limits"]["rdma/hca"] == 1  # TP1
    assert pods["decode"]["containers"][0]["resources"]["limits"]["rdma/hca"] == 2  # TP2
    args = pods["prefill"]["containers"][0]["args"]
    assert "--disaggregation-ib-device" not in args  # the plugin's devices, not a fixed list
    cfg["launch"]["k8s"]["ib_devices"] = ["mlx5_0", "mlx5_1"]
    with pytest.raises(LaunchConfigError, match="ib_devices: removed.*rdma_resource"):
        render_k8s(cfg)


def test_the_kubernetes_scrape_config_matches_the_manifests():
    """deploy/prometheus/prometheus-k8s.yaml asks DNS for the SRV records of Services the
    manifests define, by their port names."""
    scrape = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deploy/prometheus/prometheus-k8s.yaml").read_text()
    )
    names = [n for job in scrape["scrape_configs"] for sd in job["dns_sd_configs"] for n in sd["names"]]
    services = {
        (d["metadata"]["name"], p["name"])
        for d in _docs(_cfg("qwen3-coder-30b-h20-32p.yaml"))
        if d["kind"] == "Service"
        for p in d["spec"]["ports"]
    }
    for n in names:
        port, _tcp, svc, ns = n.split(".")[:4]
        assert ns == "smetric" and (svc, port.lstrip("_")) in services, n
