"""The run's episode log (``<run>/episodes/``): what people read to see what the agent did (``computerrl
episodes``). One JSON object per line. An actor writes a sample of the training episodes it plays
(``actor/recorder.py``), evaluations every episode they play, and the learner, for the groups an actor recorded,
what each turn weighed in its step (its advantages). The viewer joins them by group id.

This module owns the format's version, the writer every role uses (a thread of its own, a disk budget) and the
reader (tolerant of torn lines and of files from other versions, which it counts and says).
"""

from __future__ import annotations

import collections
import json
import queue
import threading
from pathlib import Path
from typing import Iterator

from common.jsonl import read_jsonl

RECORD_VERSION = 1
EVAL_FILE = "eval.jsonl"
"""the evaluations' episodes"""
LEARNER_FILE = "learner.jsonl"
"""the learner's advantages of the recorded groups; every other file holds episodes"""


def actor_file(rank: int) -> str:
    return f"actor-{rank}.jsonl"


class EpisodeWriter:
    """Appends records to one JSONL file from a thread of its own: ``offer`` never blocks the caller.

    A batch offered together (a group's episodes) is written whole or not at all: a group past the disk budget is
    counted (``episodes_over_budget``), one that finds the queue full too (``episodes_dropped_busy``), one that
    cannot be written (a value JSON cannot hold, a full disk) too (``episodes_not_written``); the thread goes on."""

    def __init__(self, path: Path, max_bytes: int, queue_size: int = 256):
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.bytes = self.path.stat().st_size if self.path.exists() else 0  # a resumed run appends
        self.counts: collections.Counter = collections.Counter()
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._thread = threading.Thread(target=self._run, daemon=True, name="episodes")
        self._thread.start()

    def offer(self, records: list[dict]) -> bool:
        try:
            self._queue.put_nowait(records)
            return True
        except queue.Full:
            self.counts["episodes_dropped_busy"] += len(records)
            return False

    def _run(self) -> None:
        with open(self.path, "ab") as f:
            while True:
                records = self._queue.get()
                if records is None:
                    return
                try:
                    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
                             for r in records]
                    size = sum(len(line) for line in lines)
                    if self.bytes + size > self.max_bytes:
                        self.counts["episodes_over_budget"] += len(records)
                        continue
                    f.write(b"".join(lines))
                    f.flush()
                except (TypeError, ValueError, OSError):  # a value JSON cannot hold, a full disk: this group only
                    self.counts["episodes_not_written"] += len(records)
                    continue
                self.bytes += size
                self.counts["episodes_recorded"] += len(records)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what was offered (within ``timeout_s``), then stop."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)


def read_records(path: Path, counts: collections.Counter | None = None) -> Iterator[dict]:
    """The records of one episode file in order. A line that is not JSON (a write torn by a crash) is counted as
    ``torn``, a record of another format version as ``other_version``; neither stops the reading."""
    counts = counts if counts is not None else collections.Counter()
    for rec in read_jsonl(path, counts):
        if rec.get("v") == RECORD_VERSION:
            yield rec
        else:
            counts["other_version"] += 1
