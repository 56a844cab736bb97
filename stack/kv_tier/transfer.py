"""Prefill -> decode KV hand-off over Mooncake's TransferEngine (TCP transport).

Each side creates a ``KVTransfer``: a TransferEngine initialised in P2PHANDSHAKE mode (no
metadata server; the peer name is ``host:rpc_port``) with one registered arena. The receiver
(decode) reserves a region with ``reserve(n)`` and tells the sender its ``peer`` name and the
region's address; the sender (prefill) stages its bytes in its own arena and
``write(peer, remote_addr, data)`` moves them with ``transfer_sync_write``. The receiver then
reads the region back with ``read(addr, n)``.

The arena is a simple first-fit allocator; requests bigger than the arena are sent in pieces.
``mooncake`` is imported lazily in ``start()``.
"""

from __future__ import annotations

import threading


class TransferError(RuntimeError):
    pass


class _Arena:
    """First-fit allocator over [base, base+size)."""

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size
        self.free: list[tuple[int, int]] = [(base, size)]
        self.lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        n = max(64, (n + 63) & ~63)
        with self.lock:
            for i, (a, sz) in enumerate(self.free):
                if sz >= n:
                    if sz == n:
                        self.free.pop(i)
                    else:
                        self.free[i] = (a + n, sz - n)
                    return a
        return None

    def release(self, addr: int, n: int) -> None:
        n = max(64, (n + 63) & ~63)
        with self.lock:
            self.free.append((addr, n))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for a, sz in self.free:
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((a, sz))
            self.free = merged


class KVTransfer:
    def __init__(self, host: str = "127.0.0.1", arena_bytes: int = 64 << 20):
        self.host = host
        self.arena_bytes = arena_bytes
        self._te = None
        self._arena: _Arena | None = None
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def start(self) -> KVTransfer:
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        rc = te.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"TransferEngine.initialize({self.host}) failed: rc={rc}")
        base = te.allocate_managed_buffer(self.arena_bytes)
        if not base:
            raise TransferError(f"allocate_managed_buffer({self.arena_bytes}) failed")
        self._te = te
        self._arena = _Arena(base, self.arena_bytes)
        return self

    @property
    def peer(self) -> str:
        """This engine's name for peers: ``host:rpc_port``."""
        if self._te is None:
            raise TransferError("KVTransfer not started")
        return f"{self.host}:{self._te.get_rpc_port()}"

    # receiver side -------------------------------------------------------------------------
    def reserve(self, n: int) -> int:
        assert self._arena is not None
        addr = self._arena.alloc(n)
        if addr is None:
            raise TransferError(f"receive arena full ({n} bytes requested of {self.arena_bytes})")
        return addr

    def read(self, addr: int, n: int) -> bytes:
        assert self._te is not None
        data = self._te.read_bytes_from_buffer(addr, n) if n else b""
        self.bytes_received += n
        return data

    def free(self, addr: int, n: int) -> None:
        assert self._arena is not None
        self._arena.release(addr, n)

    # sender side ---------------------------------------------------------------------------
    def write(self, peer: str, remote_addr: int, data: bytes) -> None:
        """Copy ``data`` into ``peer``'s memory at ``remote_addr`` (blocking)."""
        assert self._te is not None and self._arena is not None
        piece = max(1 << 20, self.arena_bytes // 4)
        off = 0
        with self._send_lock:
            while off < len(data):
                chunk = data[off : off + piece]
                n = len(chunk)
                src = self._arena.alloc(n)
                if src is None:
                    raise TransferError("send arena full")
                try:
                    if self._te.write_bytes_to_buffer(src, chunk, n) != 0:
                        raise TransferError("write_bytes_to_buffer failed")
                    rc = self._te.transfer_sync_write(peer, src, remote_addr + off, n)
                    if rc != 0:
                        raise TransferError(f"transfer_sync_write to {peer} failed: rc={rc}")
                finally:
                    self._arena.release(src, n)
                off += n
        self.bytes_sent += len(data)
