"""A thin wrapper over Mooncake's distributed store (``mooncake.store.MooncakeDistributedStore``).

Quirks it papers over (Mooncake 0.3): ``put`` on an existing key keeps the old value
(``upsert`` replaces); ``get`` of a missing key returns ``b""`` (here: ``None``); negative
return codes are errors (-200 store full, -706 remove right after get, -707 lease expired,
-800 for ~10 s after a segment owner died). Calls are blocking C++ calls: from asyncio run
them in a thread (``asyncio.to_thread``).

Import cost: ``mooncake`` is imported lazily inside ``MooncakeStore.connect`` so that importing
this module pulls in nothing heavy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from stack.ports import free_port

ERRORS = {
    -200: "store full (no space in any segment)",
    -706: "object busy (remove right after get)",
    -707: "lease expired",
    -800: "segment owner gone (retry in ~10 s)",
}


class MooncakeError(RuntimeError):
    def __init__(self, op: str, rc: int):
        super().__init__(f"mooncake {op} failed: rc={rc} ({ERRORS.get(rc, 'see mooncake error codes')})")
        self.rc = rc


def mooncake_available() -> tuple[bool, str]:
    """(True, "") when the Mooncake Python package imports, else (False, reason)."""
    try:
        import mooncake.engine  # noqa: F401
        import mooncake.store  # noqa: F401
    except Exception as e:  # ImportError, or a missing libibverbs
        return False, f"mooncake is not importable ({type(e).__name__}: {e}); run .ci/install-system.sh"
    return True, ""


@dataclass
class StoreConfig:
    master: str = "127.0.0.1:50051"  # mooncake_master RPC address
    metadata: str = "http://127.0.0.1:8080/metadata"  # HTTP metadata server, or "P2PHANDSHAKE"
    local_host: str = "127.0.0.1"  # this client's name is local_host:port (unique per process)
    local_port: int | None = None
    global_segment_bytes: int = 256 << 20  # memory this client contributes to the global tier
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device: str = ""


class MooncakeStore:
    """put / upsert / get / batch_is_exist over a live ``mooncake_master``.

    Thread-safe (one lock: the C++ client is shared). ``get`` returns ``None`` for a missing key.
    """

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self._store = None
        self._lock = threading.Lock()
        self.name = ""

    def connect(self) -> MooncakeStore:
        from mooncake.store import MooncakeDistributedStore

        port = self.cfg.local_port or free_port(self.cfg.local_host)
        self.name = f"{self.cfg.local_host}:{port}"
        store = MooncakeDistributedStore()
        rc = store.setup(
            self.name,
            self.cfg.metadata,
            int(self.cfg.global_segment_bytes),
            int(self.cfg.local_buffer_bytes),
            self.cfg.protocol,
            self.cfg.device,
            self.cfg.master,
        )
        if rc != 0:
            raise MooncakeError(f"setup(master={self.cfg.master}, metadata={self.cfg.metadata})", rc)
        self._store = store
        return self

    @property
    def connected(self) -> bool:
        return self._store is not None

    def _s(self):
        if self._store is None:
            raise RuntimeError("MooncakeStore is not connected (call connect())")
        return self._store

    def put(self, key: str, value: bytes) -> None:
        """Write ``key`` if absent (an existing key keeps its old value: Mooncake semantics)."""
        with self._lock:
            rc = self._s().put(key, value)
        if rc != 0:
            raise MooncakeError(f"put({key!r})", rc)

    def upsert(self, key: str, value: bytes) -> None:
        with self._lock:
            rc = self._s().upsert(key, value)
        if rc != 0:
            raise MooncakeError(f"upsert({key!r})", rc)

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> int:
        """Write the keys that are absent; returns how many were written. Existing keys are
        skipped (their value is content-addressed: the same)."""
        if not keys:
            return 0
        exist = self.batch_is_exist(keys)
        todo = [(k, v) for k, v, e in zip(keys, values, exist, strict=True) if not e]
        if not todo:
            return 0
        with self._lock:
            rc = self._s().put_batch([k for k, _ in todo], [v for _, v in todo])
        if rc != 0:
            raise MooncakeError(f"put_batch({len(todo)} keys)", rc)
        return len(todo)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            v = self._s().get(key)
        return v if v else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._lock:
            vals = self._s().get_batch(list(keys))
        return [v if v else None for v in vals]

    def is_exist(self, key: str) -> bool:
        with self._lock:
            return self._s().is_exist(key) == 1

    def batch_is_exist(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            res = self._s().batch_is_exist(list(keys))
        return [r == 1 for r in res]

    def remove(self, key: str) -> None:
        with self._lock:
            self._s().remove(key)

    def close(self) -> None:
        if self._store is not None:
            with self._lock:
                try:
                    self._store.close()
                finally:
                    self._store = None
