"""Launcher output that can never hang the launcher.

`smetric up` reports progress on stderr and prints one JSON line on stdout. Either may be a
pipe that nobody drains (a test that reads one line, a supervisor that ignores the child's
output): once its buffer is full, a plain ``write`` blocks forever, and a launcher blocked in
``print("stopping ...")`` never stops its workers. :class:`NeverBlockingWriter` waits a
bounded time for room in the pipe and otherwise drops the text (counting what it dropped),
so shutdown is bounded whatever the output is connected to. Terminals and files never fill,
so for them nothing changes.
"""

from __future__ import annotations

import io
import os
import select

# a write of at most PIPE_BUF bytes to a pipe that select() calls writable never blocks
_CHUNK = select.PIPE_BUF


class NeverBlockingWriter(io.TextIOBase):
    """A text stream over ``fd`` whose writes wait at most ``timeout_s`` for room, per chunk."""

    def __init__(self, fd: int, timeout_s: float = 2.0) -> None:
        super().__init__()
        self._fd = fd
        self.timeout_s = timeout_s
        self.dropped_bytes = 0
        self._stuck = False  # once a write timed out, later ones do not wait again

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        data = s.encode("utf-8", errors="replace")
        view = memoryview(data)
        while view:
            wait = 0.0 if self._stuck else self.timeout_s
            try:
                _, ready, _ = select.select([], [self._fd], [], wait)
            except (OSError, ValueError):
                ready = []
            if not ready:
                self._stuck = True
                self.dropped_bytes += len(view)
                break
            try:
                n = os.write(self._fd, view[:_CHUNK])
            except BlockingIOError:
                continue
            except OSError:  # closed reader (EPIPE) or a bad fd: nothing more can be said
                self.dropped_bytes += len(view)
                break
            self._stuck = False
            view = view[n:]
        return len(s)

    def flush(self) -> None:
        pass
