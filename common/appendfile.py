"""A text file that lines are appended to, best-effort: a full disk (a quota reached) drops lines, counted, instead
of raising out of whatever was logging or recording metrics, and the file is taken up again once it can be.

For what may be lost while the disk is full: log lines and metrics records. (What may not be lost has its own
rules: the spill log's, the audit log's, the checkpoints'.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, TextIO

REOPEN_AFTER_S = 5.0  # after a failed write, how long lines are dropped before the file is tried again


def close_quietly(f: IO | None) -> bool:
    """Close a file whose writes failed (its close flushes what its buffer holds, which may fail the same way);
    whether it closed cleanly."""
    if f is None:
        return True
    try:
        f.close()
        return True
    except OSError:
        return False


class BestEffortAppender:
    """``write(text)`` appends (flushed at once); after a failure the file is let go, lines are dropped for
    ``REOPEN_AFTER_S``, and then it is reopened and begins with a newline, so a line the failure cut short stays
    apart from the next (readers skip a garbled line). ``dropped`` counts the writes lost since the last success,
    ``failures`` every failed write."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.failures = 0
        self.dropped = 0
        self._retry_at = 0.0
        self._torn = False  # a write failed since the file was last open: it may end in a partial line
        self._f: TextIO | None = None
        self._open()  # (on a full disk even creating it may fail: then at the first write past the wait)

    def _open(self) -> bool:
        try:
            self._f = open(self.path, "a", buffering=1)
            if self._torn:
                self._f.write("\n")  # (after a line the failure cut short)
        except OSError:
            return self._failed()
        self._torn = False
        return True

    def write(self, text: str) -> bool:
        """Whether ``text`` reached the file."""
        if self._f is None and (time.monotonic() < self._retry_at or not self._open()):
            self.dropped += 1
            return False
        try:
            self._f.write(text)
            self._f.flush()
        except OSError:
            self.dropped += 1
            return self._failed()
        self.dropped = 0
        return True

    def _failed(self) -> bool:
        self.failures += 1
        self._torn = True
        self._retry_at = time.monotonic() + REOPEN_AFTER_S
        f, self._f = self._f, None
        close_quietly(f)
        return False

    def close(self) -> None:
        f, self._f = self._f, None
        if not close_quietly(f):
            self.failures += 1
