"""A process to launch: the common currency of every launcher (local, per node, k8s).

The error a launcher raises when a config cannot be turned into processes lives here too, so
that the builders shared by several launchers (``stack.launch.router_spec``) can raise the one
exception every caller already handles, without importing a particular launcher.
"""

from __future__ import annotations

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
    gpus: list[int] = field(default_factory=list)
    #: files the process reads, written (path -> text) on its node just before it starts
    files: dict[str, str] = field(default_factory=dict)
