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

A Redis that listens beyond loopback gets a password (``requirepass``), always: the env var
``SMETRIC_REDIS_PASSWORD`` (``launch.redis.password_env``) holds it, the redis-server command
line and every router replica read it from there (``$(NAME)`` in argv, ``router.redis_password_env``
in the router config), and the launcher starts neither without it. ``smetric up`` generates one
when the variable is unset and keeps it in ``<run_dir>/redis.password`` (mode 0600), so later
starts from the same run dir get the same; per-node launches on several machines export the same
value on each (Kubernetes: a Secret). ``launch.redis.password: true`` asks for one on loopback
too. ``launch.redis.tls: {cert_file, key_file, ca_file}``: Redis speaks TLS only (``--tls-port``),
the routers connect with ``rediss://`` and check its certificate against ``ca_file``.

Pure data, but for :func:`ensure_password`: nothing is started here.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from pathlib import Path
from typing import Any

from stack.launch.spec import ENV_NAME

#: an automatically started Redis listens on router.port + this (fixed ports)
AUTO_REDIS_OFFSET = 379
#: the env var holding the Redis password unless ``launch.redis.password_env`` names another
REDIS_PASSWORD_ENV = "SMETRIC_REDIS_PASSWORD"
#: where ``smetric up`` keeps a password it generated, under the run dir
PASSWORD_FILE = "redis.password"
_TLS_KEYS = ("cert_file", "key_file", "ca_file")


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


def redis_password_env(redis: dict[str, Any] | None, loopback: bool) -> str | None:
    """The env var holding the password of the Redis ``redis`` (``launch.redis``) describes, or
    None when it needs none (loopback only, ``password`` not true). Beyond loopback a password is
    required: ``password: false`` there is refused."""
    rd = redis if isinstance(redis, dict) else {}
    want = rd.get("password")
    if want is not None and not isinstance(want, bool):
        raise ReplicaConfigError(f"launch.redis.password: true or false (got {want!r})")
    if want is False and not loopback:
        raise ReplicaConfigError(
            "launch.redis.password: false, but Redis listens beyond loopback: anyone on the network "
            "could read and rewrite the routers' shared state; keep the password (the default)"
        )
    if not (want or not loopback):
        return None
    name = rd.get("password_env", REDIS_PASSWORD_ENV)
    if not isinstance(name, str) or not ENV_NAME.match(name):
        raise ReplicaConfigError(f"launch.redis.password_env: an environment variable name (got {name!r})")
    return name


def redis_tls(redis: dict[str, Any] | None) -> dict[str, str] | None:
    """``launch.redis.tls`` (``{cert_file, key_file, ca_file}``: paths on the Redis node and, for
    ``ca_file``, on the routers' node) or None."""
    tls = (redis or {}).get("tls") if isinstance(redis, dict) else None
    if not tls:
        return None
    if not isinstance(tls, dict) or any(not isinstance(tls.get(k), str) or not tls[k] for k in _TLS_KEYS):
        raise ReplicaConfigError(f"launch.redis.tls: a mapping with {', '.join(_TLS_KEYS)} (got {tls!r})")
    return {k: str(tls[k]) for k in _TLS_KEYS}


def redis_url(host: str, port: int, tls: dict[str, str] | None = None) -> str:
    """The routers' ``router.redis_url`` of a Redis on ``host:port`` (``rediss://`` with TLS, the
    certificate checked against ``tls['ca_file']``; the password comes from
    ``router.redis_password_env``, never the URL)."""
    h = f"[{host}]" if ":" in host else host
    if not tls:
        return f"redis://{h}:{port}/0"
    return f"rediss://{h}:{port}/0?ssl_ca_certs={urllib.parse.quote(tls['ca_file'])}"


def redis_argv(
    binary: str,
    port: int,
    bind: str,
    loopback: bool,
    extra: list[str] | None = None,
    password_env: str | None = None,
    tls: dict[str, str] | None = None,
) -> list[str]:
    """redis-server for the router replicas' shared state: no persistence (nothing written to
    the working directory), protected mode unless it listens beyond loopback, ``requirepass
    $(password_env)`` (the launcher or Kubernetes puts the value in), and with ``tls`` TLS only
    on ``port`` (no plain-text port; clients are not asked for certificates)."""
    ports = ["--port", str(port)]
    if tls:
        ports = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls["cert_file"]]
        ports += ["--tls-key-file", tls["key_file"], "--tls-ca-cert-file", tls["ca_file"]]
        ports += ["--tls-auth-clients", "no"]
    auth = ["--requirepass", f"$({password_env})"] if password_env else []
    return [
        binary,
        *ports,
        "--bind",
        bind,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "yes" if loopback else "no",
        *auth,
        *(extra or []),
    ]


def ensure_password(name: str, run_dir: Path | str) -> str:
    """The Redis password in env var ``name``: as the environment has it, else the one kept in
    ``<run_dir>/redis.password``, else a new random one written there (mode 0600). It is put in
    this process's environment, which the processes the launcher starts inherit."""
    value = os.environ.get(name)
    path = Path(run_dir) / PASSWORD_FILE
    if not value and path.is_file():
        value = path.read_text().strip()
    if not value:
        value = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value + "\n")
    os.environ[name] = value
    return value


def provide_password(launch: dict[str, Any], specs: list) -> str | None:
    """Before ``smetric up`` starts ``specs``: the Redis password their ``$(NAME)`` needs
    (:func:`ensure_password`), when one of them is a Redis that wants one; its env var, or None."""
    names = {n for s in specs if s.role == "redis" for n in s.secret_env}
    if not names:
        return None
    (name,) = names
    ensure_password(name, launch.get("run_dir", ".smetric/run"))
    return name
