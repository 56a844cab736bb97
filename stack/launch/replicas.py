"""Router replicas for the launchers: how many, on which ports, and the Redis they share.

``launch.router.replicas: N`` (default 1) starts N router processes in front of one pool.
Replica ``i`` listens on ``router.port + i`` (or ``launch.router.ports[i]``) and gets
``--replica-id r{i}``; every replica reads the same router config, whose ``router.redis_url``
points at the shared Redis (docs/router.md, "Replicas").

With N > 1 the replicas need Redis. :func:`ensure_redis` settles where it comes from:

- ``launch.redis: {port, node, ...}``: the launcher starts it (as before);
- ``router.redis_url`` given: an external Redis, nothing is started;
- neither: the launcher starts a private redis-server on the router's node, on port
  ``router.port + 379`` (8379 by default; a free port with ``--ports auto``);
- ``launch.redis: null`` / ``false`` written out explicitly: refused, with a message.

Pure data: nothing is started here.
"""

from __future__ import annotations

from typing import Any

#: an automatically started Redis listens on router.port + this (fixed ports)
AUTO_REDIS_OFFSET = 379


class ReplicaConfigError(ValueError):
    """``launch.router.replicas`` / ``ports`` / ``launch.redis`` do not fit together."""


def router_section(launch: dict[str, Any]) -> dict[str, Any]:
    r = launch.get("router")
    if r is False or r is None:
        return {"enabled": False} if r is False else {}
    if not isinstance(r, dict):
        raise ReplicaConfigError("launch.router: must be a mapping (or false)")
    return r


def router_enabled(launch: dict[str, Any]) -> bool:
    return bool(router_section(launch).get("enabled", True))


def replica_count(launch: dict[str, Any]) -> int:
    """N of ``launch.router.replicas`` (default: the length of ``ports``, else 1)."""
    r = router_section(launch)
    ports = r.get("ports")
    n = r.get("replicas", len(ports) if isinstance(ports, list) and ports else 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ReplicaConfigError(f"launch.router.replicas: must be an integer >= 1 (got {n!r})")
    return n


def replica_ports(cfg: dict[str, Any]) -> list[int]:
    """The configured port of each replica: ``launch.router.ports`` or ``router.port + i``."""
    launch = cfg.get("launch") or {}
    n = replica_count(launch)
    ports = router_section(launch).get("ports")
    if ports is not None:
        if not isinstance(ports, list) or len(ports) != n:
            raise ReplicaConfigError(f"launch.router.ports: give one port per replica ({n}), got {ports!r}")
        out = [int(p) for p in ports]
        if len(set(out)) != len(out):
            raise ReplicaConfigError(f"launch.router.ports: duplicate port in {out}")
        return out
    base = int((cfg.get("router") or {}).get("port", 8000))
    return [base + i for i in range(n)]


def replica_id(i: int) -> str:
    return f"r{i}"


def replica_args(i: int, port: int, n: int) -> list[str]:
    """Extra ``smetric router`` flags of replica ``i`` (none for a lone router)."""
    return [] if n == 1 else ["--port", str(port), "--replica-id", replica_id(i)]


def replica_name(i: int, n: int) -> str:
    return "router" if n == 1 else f"router-{i}"


def ensure_redis(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill in ``launch.redis`` when the replicas need a Redis the launcher should start.

    Mutates and returns ``cfg``. A config with one replica, or whose router is disabled, is
    left alone. The filled-in section is marked ``auto: true``.
    """
    launch = cfg.get("launch")
    if not isinstance(launch, dict) or not router_enabled(launch):
        return cfg
    n = replica_count(launch)
    if n == 1:
        return cfg
    if launch.get("redis"):
        return cfg
    if (cfg.get("router") or {}).get("redis_url"):
        return cfg  # an external Redis: nothing to start
    if "redis" in launch:
        raise ReplicaConfigError(
            f"launch.router.replicas: {n} router replicas share state through Redis, but "
            "launch.redis is null: give launch.redis: {port: ...} (the launcher starts it), "
            "router.redis_url (an existing Redis), or remove launch.redis to have one started"
        )
    base = int((cfg.get("router") or {}).get("port", 8000))
    launch["redis"] = {"port": base + AUTO_REDIS_OFFSET, "auto": True}
    return cfg


def redis_argv(
    binary: str, port: int, bind: str, loopback: bool, extra: list[str] | None = None
) -> list[str]:
    """redis-server for the router replicas' shared state: no persistence (nothing written to
    the working directory), protected mode unless it listens beyond loopback."""
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        bind,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "yes" if loopback else "no",
        *(extra or []),
    ]
