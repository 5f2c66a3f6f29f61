"""Metric records as their readers see them: every whole record of a JSONL file, and every measurement in one.

Roles write records with ``common.metrics.writer.MetricsWriter``; the curve, sweeps, the TensorBoard / W&B forwarder
and the Prometheus exposition read them through these functions; the live views take a file's newest record.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

from common.jsonl import read_jsonl

RECORD_KEYS = ("time", "role", "rank")
"""what every record carries about itself (when, who); not measurements"""


def numeric_fields(record: dict, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """Every measurement of a metric record as (path of keys, value): nested dicts are walked (a histogram is a
    dict of counts), booleans count as 0/1; the record's own keys (``RECORD_KEYS``), strings, lists, NaN and
    infinities are left out. TensorBoard, W&B and Prometheus all read records through this."""
    for key, value in record.items():
        if not path and key in RECORD_KEYS:
            continue
        here = (*path, str(key))
        if isinstance(value, dict):
            yield from numeric_fields(value, here)
        elif isinstance(value, bool):
            yield here, float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            yield here, float(value)


def read_records(path: Path) -> list[dict]:
    """Every whole JSON record of a JSONL file (a torn or foreign line is skipped); [] when there is none."""
    return list(read_jsonl(path))


def last_record(path: Path, max_bytes: int = 65536) -> dict | None:
    """The newest whole JSON record of a metrics file (read from its end), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
