"""Reading back the JSON-lines files the roles append to (metric records, the audit trail, the episode log): one
place that knows a line may be torn by a crash mid-write and that such a line is skipped, never a failure."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Iterator


def read_jsonl(path: Path, counts: collections.Counter | None = None) -> Iterator[dict]:
    """The JSON objects of a file's lines, in order; nothing when the file does not exist. A line that is not a JSON
    object (torn by a crash, or foreign) is skipped and, with ``counts``, counted as ``torn``."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                rec = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                yield rec
            elif counts is not None:
                counts["torn"] += 1
