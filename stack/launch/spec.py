"""A process to launch: the common currency of every launcher (local, per node, k8s).

The error a launcher raises when a config cannot be turned into processes lives here too, so
that the builders shared by several launchers (``stack.launch.router_spec``) can raise the one
exception every caller already handles, without importing a particular launcher.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field


class LaunchConfigError(ValueError):
    """The ``launch`` section cannot be turned into processes (a readable one-line reason)."""


@dataclass(slots=True)
class ProcessSpec:
    """One process of a deployment.

    ``role``: mooncake_master | redis | lmcache_server | lmcache_controller | prefill | decode |
    router | metadata.
    ``ready_url``: an HTTP URL answering 200 when the process is ready (None: a TCP port or
    nothing to wait for); ``also_ready``: more such URLs (every worker of a pool process).
    """

    name: str
    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    node: str = "local"
    ready_url: str | None = None
    #: further URLs that must answer 200 too (a process hosting a pool of workers)
    also_ready: list[str] = field(default_factory=list)
    ready_port: int | None = None
    #: seconds it may take to stop on SIGTERM before it gets SIGKILL (None: launch.stop_grace_s);
    #: a router's covers its drain (:func:`stack.launch.router_spec.drain_grace_s`)
    stop_grace_s: float | None = None
    gpus: list[int] = field(default_factory=list)
    #: files the process reads, written (path -> text) on its node just before it starts
    files: dict[str, str] = field(default_factory=dict)
    #: env vars holding secrets (e.g. the workers' API keys) the process needs: never written
    #: into the spec; the launcher's environment has them (Kubernetes: a Secret), and a
    #: ``$(NAME)`` in ``argv`` stands for one (:func:`expand_secrets`; Kubernetes expands it
    #: itself)
    secret_env: list[str] = field(default_factory=list)


#: ``$(NAME)`` in an argument: the value of the env var NAME (Kubernetes' own syntax in args)
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
#: what a secret's env var may be called
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def expand_secrets(spec: ProcessSpec, env: Mapping[str, str]) -> list[str]:
    """``spec.argv`` with each ``$(NAME)`` of ``spec.secret_env`` replaced by its value in
    ``env``; a secret that is not set is a :class:`LaunchConfigError` naming it."""
    missing = [n for n in spec.secret_env if not env.get(n)]
    if missing:
        raise LaunchConfigError(
            f"{spec.name}: the environment variable(s) {', '.join(missing)} must hold its secret(s) "
            "(e.g. the workers' API keys: launch.sglang.api_key_env / admin_api_key_env)"
        )
    names = set(spec.secret_env)
    if not names:
        return list(spec.argv)
    return [ENV_REF.sub(lambda m: env[m[1]] if m[1] in names else m[0], a) for a in spec.argv]


#: seconds a launcher waits for each phase to be ready when ``launch.ready_timeout_s`` is unset:
#: an emulated stack is up in seconds; a real SGLang worker loads weights first (a 30B model on a
#: GPU: its 61 GB of weights, CUDA graph capture and JIT warm-up take minutes on a first start;
#: the tiny CPU-tier model alone took 36 s on 2 cores: docs/deploy/bare-metal.md, "Health and readiness")
READY_TIMEOUT_S = {"emulate": 60.0, "sglang": 900.0}


def ready_timeout_s(launch: Mapping, override: float | None = None) -> float:
    """How long to wait for readiness: ``override`` (``--ready-timeout``), else
    ``launch.ready_timeout_s``, else the engine's default (:data:`READY_TIMEOUT_S`)."""
    if override:
        return float(override)
    if launch.get("ready_timeout_s") is not None:
        return float(launch["ready_timeout_s"])
    return READY_TIMEOUT_S.get(str(launch.get("engine", "emulate")), READY_TIMEOUT_S["emulate"])


def kv_replay_base(pool: Mapping, stride: int) -> int | None:
    """The first instance's KV-event replay port of a pool (+ stride for each next one), or None
    for no replay: ``kv_replay_port`` when the pool sets it (null: off); unset, the port after
    ``kv_events_port`` (SGLang's convention, replay = kv + 1) when the stride leaves it free,
    else none (a stride of 1 gives that port to the next instance's events: set it)."""
    if pool.get("kv_events_port") is None:
        return None
    if "kv_replay_port" in pool:
        return None if pool["kv_replay_port"] is None else int(pool["kv_replay_port"])
    return int(pool["kv_events_port"]) + 1 if stride >= 2 else None
