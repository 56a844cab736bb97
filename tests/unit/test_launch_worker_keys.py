"""The workers' API keys through the launchers: ``launch.sglang.api_key_env`` /
``admin_api_key_env`` name env vars; the workers get ``--api-key $(NAME)`` /
``--admin-api-key $(NAME)``, substituted only when a process starts (never in a spec, a dry run,
a log line or a manifest: Kubernetes reads them from a Secret), and the router's config names
the same variables."""

from __future__ import annotations

import pytest
import yaml

from stack.launch.k8s import render_k8s
from stack.launch.sglang import dry_run_text, resolved_config, sglang_process_specs
from stack.launch.spec import LaunchConfigError, ProcessSpec, expand_secrets
from stack.paths import configs_dir

SECRET = "s3cret-worker-key-value"
ADMIN_SECRET = "s3cret-admin-key-value"
KEYS = {"api_key_env": "SMETRIC_WORKER_API_KEY", "admin_api_key_env": "SMETRIC_WORKER_ADMIN_KEY"}


def _gpu_config() -> dict:
    cfg = yaml.safe_load((configs_dir() / "qwen3-coder-30b-h200-1node.yaml").read_text())
    cfg["launch"].setdefault("sglang", {}).update(KEYS)
    return cfg


@pytest.fixture(autouse=True)
def _secrets(monkeypatch):
    monkeypatch.setenv("SMETRIC_WORKER_API_KEY", SECRET)
    monkeypatch.setenv("SMETRIC_WORKER_ADMIN_KEY", ADMIN_SECRET)


def test_specs_carry_references_never_keys():
    specs = sglang_process_specs(_gpu_config())
    workers = [s for s in specs if s.role in ("prefill", "decode")]
    assert workers
    for s in workers:
        i = s.argv.index("--api-key")
        assert s.argv[i + 1] == "$(SMETRIC_WORKER_API_KEY)"
        assert s.argv[s.argv.index("--admin-api-key") + 1] == "$(SMETRIC_WORKER_ADMIN_KEY)"
        assert s.secret_env == list(KEYS.values())
        assert SECRET not in repr(s) and ADMIN_SECRET not in repr(s)
    routers = [s for s in specs if s.role == "router"]
    assert routers and all(s.secret_env == list(KEYS.values()) for s in routers)
    auth = resolved_config(_gpu_config())["router"]["auth"]
    assert auth["worker_api_key_env"] == "SMETRIC_WORKER_API_KEY"
    assert auth["worker_admin_api_key_env"] == "SMETRIC_WORKER_ADMIN_KEY"


def test_dry_run_lets_the_shell_expand_them():
    text = dry_run_text(_gpu_config())
    assert '--api-key "$SMETRIC_WORKER_API_KEY"' in text
    assert '--admin-api-key "$SMETRIC_WORKER_ADMIN_KEY"' in text
    assert SECRET not in text and ADMIN_SECRET not in text


def test_the_launcher_substitutes_at_start_and_refuses_a_missing_one():
    s = ProcessSpec("p", "prefill", ["python3", "--api-key", "$(K1)", "--x", "$(OTHER)"], secret_env=["K1"])
    assert expand_secrets(s, {"K1": "v1"}) == ["python3", "--api-key", "v1", "--x", "$(OTHER)"]
    with pytest.raises(LaunchConfigError, match="K1"):
        expand_secrets(s, {})


def test_kubernetes_reads_them_from_a_secret():
    docs = [d for text in render_k8s(_gpu_config()).values() for d in yaml.safe_load_all(text) if d]
    text = yaml.safe_dump_all(docs)
    assert SECRET not in text and ADMIN_SECRET not in text
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if d["kind"] in ("StatefulSet", "Deployment")
    }
    for name in ("prefill", "decode", "smetric-router"):
        env = {e["name"]: e for e in pods[name]["env"]}
        for var in KEYS.values():
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "smetric-keys", "key": var}, name
    assert "$(SMETRIC_WORKER_API_KEY)" in pods["prefill"]["args"]


def test_bad_env_names_are_refused():
    cfg = _gpu_config()
    cfg["launch"]["sglang"]["api_key_env"] = "not a name"
    with pytest.raises(LaunchConfigError, match="api_key_env"):
        sglang_process_specs(cfg)
