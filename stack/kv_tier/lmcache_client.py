"""The worker's side of the LMCache tier: a client of one LMCache engine sidecar
(:mod:`stack.kv_tier.lmcache_engine_sidecar`, run in LMCache's environment), and how to start one.

``LMCacheClient(url).store(tokens, kv) / lookup(tokens) / retrieve(tokens)``: blocking HTTP/JSON
calls (KV bytes as base64), each bounded by ``timeout_s``; a sidecar that answers an error
raises :class:`LMCacheTierError` with its message. :func:`sidecar_argv` is the command line
(the launcher and the tests build it here, so they agree).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LMCacheClient", "LMCacheTierError", "Retrieved", "lmcache_python", "sidecar_argv", "SIDECAR_ENV"]

#: LMCache hashes chunks with Python's hash(): every engine and the controller share the seed
SIDECAR_ENV = {"PYTHONHASHSEED": "0", "LMCACHE_DISABLE_BANNER": "1"}


class LMCacheTierError(RuntimeError):
    """The sidecar could not be reached or refused the call."""


@dataclass(frozen=True, slots=True)
class Retrieved:
    hit_tokens: int
    kv: bytes


def lmcache_python() -> str | None:
    """LMCache's interpreter: ``$SMETRIC_LMCACHE_PYTHON``, else ``$LMCACHE_VENV/bin/python``
    (default /opt/lmcache-venv), when it exists."""
    cands = [os.environ.get("SMETRIC_LMCACHE_PYTHON")]
    cands.append(str(Path(os.environ.get("LMCACHE_VENV", "/opt/lmcache-venv")) / "bin" / "python"))
    for c in cands:
        if c and Path(c).exists():
            return c
    return None


def sidecar_argv(
    python: str,
    instance_id: str,
    port: int,
    *,
    controller: tuple[str, str] | None = None,
    worker_port: int | None = None,
    mooncake_master: str | None = None,
    mooncake_port: int | None = None,
    chunk_size: int = 256,
    kv_bytes_per_token: int = 16,
    host: str = "127.0.0.1",
) -> list[str]:
    a = [python, "-m", "stack.kv_tier.lmcache_engine_sidecar", "--instance-id", instance_id]
    a += ["--host", host, "--port", str(port), "--chunk-size", str(chunk_size)]
    a += ["--kv-bytes-per-token", str(kv_bytes_per_token)]
    if controller:
        a += ["--controller", f"{controller[0]},{controller[1]}", "--worker-port", str(worker_port)]
    if mooncake_master:
        a += ["--mooncake-master", mooncake_master, "--mooncake-port", str(mooncake_port)]
    return a


class LMCacheClient:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:  # noqa: BLE001 - not our error shape
                msg = f"HTTP {e.code}"
            raise LMCacheTierError(f"{self.url}{path}: {msg}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise LMCacheTierError(f"{self.url}{path}: {e}") from None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=self.timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def store(self, tokens: Sequence[int], kv: bytes) -> int:
        """Store the KV of ``tokens`` (whole chunks of it); returns the tokens stored."""
        body = {"tokens": [int(t) for t in tokens], "kv_b64": base64.b64encode(kv).decode()}
        return int(self._post("/store", body)["stored_tokens"])

    def lookup(self, tokens: Sequence[int]) -> int:
        return int(self._post("/lookup", {"tokens": [int(t) for t in tokens]})["hit_tokens"])

    def retrieve(self, tokens: Sequence[int]) -> Retrieved:
        """The KV of the longest prefix of ``tokens`` LMCache holds (local CPU, else the store)."""
        r = self._post("/retrieve", {"tokens": [int(t) for t in tokens]})
        return Retrieved(int(r["hit_tokens"]), base64.b64decode(r["kv_b64"]))
