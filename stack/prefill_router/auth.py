"""API keys of the router's clients (``router.auth``), and the keys the router gives workers.

Client keys are read from a YAML (or JSON) file, or an env var holding the same text::

    defaults:                      # limits of every key that sets none of its own (optional)
      requests_per_s: 10
    keys:
      - name: team-a               # what metrics and logs show: never the key
        sha256: 3f1c...            # hex SHA-256 of the key (or ``key: sk-...``, hashed at load)
        requests_per_s: 5          # request rate (token bucket), burst ``request_burst``
        request_burst: 10          # default: max(1, requests_per_s)
        prompt_tokens_per_s: 20000 # prompt-token rate, burst ``prompt_token_burst``
        prompt_token_burst: 80000  # default: prompt_tokens_per_s
        max_concurrency: 4         # requests in flight

Only SHA-256 digests are kept: a plaintext ``key`` is hashed as the file is read and the parsed
text dropped. A presented key is hashed and looked up by digest, and the digest found is
compared again with :func:`hmac.compare_digest`: the lookup compares digests, never the key,
so its timing says nothing an attacker could use without a SHA-256 preimage.

:func:`load_keys` raises :class:`AuthConfigError` (a ``ValueError``: ``smetric router`` prints
it and exits 2) naming the file or variable and the reason. The HTTP side (headers, answers,
metrics) is :mod:`stack.prefill_router.api.gate`; the limits, :mod:`stack.prefill_router.limits`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stack.config import AuthConfig
from stack.prefill_router.limits import Limits

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_LIMIT_FIELDS = (
    "requests_per_s",
    "request_burst",
    "prompt_tokens_per_s",
    "prompt_token_burst",
    "max_concurrency",
)


class AuthConfigError(ValueError):
    """The keys (or a worker key) cannot be read: the message names where and why."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client key as the router keeps it: its name, digest and limits."""

    name: str
    digest: bytes
    limits: Limits


def digest(key: str | bytes) -> bytes:
    """SHA-256 of a key (what is kept and looked up)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyStore:
    """The client keys, by digest (replaced whole on reload)."""

    def __init__(self, keys: list[ApiKey], source: str) -> None:
        self.by_digest = {k.digest: k for k in keys}
        self.source = source

    def __len__(self) -> int:
        return len(self.by_digest)

    @property
    def names(self) -> list[str]:
        return sorted(k.name for k in self.by_digest.values())

    def find(self, presented: bytes) -> ApiKey | None:
        """The key whose digest matches ``presented``'s, or None."""
        d = hashlib.sha256(presented).digest()
        k = self.by_digest.get(d)
        if k is None or not hmac.compare_digest(k.digest, d):
            return None
        return k


def load_keys(cfg: AuthConfig) -> KeyStore:
    """The keys ``cfg`` names (``keys_file``, else ``keys_env``), checked whole."""
    if cfg.keys_file:
        where = f"router.auth.keys_file {cfg.keys_file}"
        try:
            text = Path(cfg.keys_file).read_text()
        except OSError as e:
            raise AuthConfigError(f"{where}: cannot read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise AuthConfigError(f"{where}: not UTF-8 text: {e.reason}") from None
    elif cfg.keys_env:
        where = f"router.auth.keys_env {cfg.keys_env}"
        text = os.environ.get(cfg.keys_env)
        if text is None:
            raise AuthConfigError(f"{where}: the environment variable is not set")
    else:
        raise AuthConfigError("router.auth: neither keys_file nor keys_env is set")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AuthConfigError(f"{where}: not valid YAML/JSON: {e}") from None
    del text
    return KeyStore(parse_keys(data, where), where)


def parse_keys(data: Any, where: str) -> list[ApiKey]:
    """The keys of a parsed keys document (module docstring), or :class:`AuthConfigError`."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise AuthConfigError(f"{where}: expected a mapping with a 'keys' list")
    extra = set(data) - {"keys", "defaults"}
    if extra:
        raise AuthConfigError(f"{where}: unknown top-level field(s) {sorted(extra)}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise AuthConfigError(f"{where}: 'defaults' must be a mapping of limits")
    if not data["keys"]:
        raise AuthConfigError(f"{where}: no keys (every request would be refused)")
    out: list[ApiKey] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, item in enumerate(data["keys"]):
        at = f"{where}: keys[{i}]"
        if not isinstance(item, dict):
            raise AuthConfigError(f"{at}: must be a mapping")
        unknown = set(item) - {"name", "key", "sha256", *_LIMIT_FIELDS}
        if unknown:
            raise AuthConfigError(f"{at}: unknown field(s) {sorted(unknown)}")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise AuthConfigError(f"{at}: 'name' must be 1-64 characters of letters, digits and ._:@-")
        at = f"{where}: key {name!r}"
        if name in names:
            raise AuthConfigError(f"{at}: the name is used twice")
        d = _key_digest(item, at)
        if d in digests:
            raise AuthConfigError(f"{at}: the same key as another entry")
        limits = _limits({**defaults, **{k: v for k, v in item.items() if k in _LIMIT_FIELDS}}, at)
        names.add(name)
        digests.add(d)
        out.append(ApiKey(name, d, limits))
    return out


def _key_digest(item: dict, at: str) -> bytes:
    key, sha = item.get("key"), item.get("sha256")
    if (key is None) == (sha is None):
        raise AuthConfigError(f"{at}: give exactly one of 'key' (plaintext) or 'sha256' (its hex digest)")
    if sha is not None:
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise AuthConfigError(f"{at}: 'sha256' must be 64 hex digits")
        return bytes.fromhex(sha)
    if not isinstance(key, str) or len(key) < 8 or not key.isprintable() or key.strip() != key:
        raise AuthConfigError(f"{at}: 'key' must be a string of at least 8 printable characters")
    return digest(key)


def _limits(d: dict, at: str) -> Limits:
    for k, v in d.items():
        if k not in _LIMIT_FIELDS:
            raise AuthConfigError(f"{at}: unknown limit {k!r} in defaults")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
            raise AuthConfigError(f"{at}: '{k}' must be a positive number")
    if d.get("max_concurrency") is not None and not float(d["max_concurrency"]).is_integer():
        raise AuthConfigError(f"{at}: 'max_concurrency' must be a whole number")
    try:
        return Limits.of(**{k: v for k, v in d.items() if v is not None})
    except ValueError as e:
        raise AuthConfigError(f"{at}: {e}") from None


def worker_keys(cfg: AuthConfig) -> tuple[str | None, str | None]:
    """(the workers' ``--api-key``, their ``--admin-api-key``) from the env vars ``cfg`` names;
    a named variable that is unset is an :class:`AuthConfigError`."""
    out = []
    for field in ("worker_api_key_env", "worker_admin_api_key_env"):
        var = getattr(cfg, field)
        if not var:
            out.append(None)
            continue
        v = os.environ.get(var)
        if not v:
            raise AuthConfigError(f"router.auth.{field} {var}: the environment variable is not set")
        out.append(v.strip())
    return out[0], out[1]


def worker_headers(cfg: AuthConfig) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """(headers of every call to a worker, headers of ``/abort_request``): ``Authorization:
    Bearer`` with the workers' API key, and with their admin key for aborts (SGLang 0.5.23
    accepts only the admin key there once one is set; without one, the API key)."""
    api, admin = worker_keys(cfg)
    every = {"Authorization": f"Bearer {api}"} if api else None
    abort_key = admin or api
    return every, ({"Authorization": f"Bearer {abort_key}"} if abort_key else None)
