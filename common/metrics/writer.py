"""Metrics a role writes: JSONL records in the run directory (read back through common.metrics.records), plus a
fixed-bucket histogram and percentiles."""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Sequence

from common.appendfile import BestEffortAppender


class MetricsWriter:
    """Appends one JSON object per line to ``<dir>/<name>.jsonl``; a ``None`` path discards. With ``prometheus``
    (HOST:PORT, from the role's config) the newest record is also served as Prometheus ``/metrics``
    (``common/metrics/prometheus.py``)."""

    def __init__(self, path: str | Path | None, prometheus: str = "", role: str = "", rank: int = 0):
        self.path = Path(path) if path is not None else None
        self._f: BestEffortAppender | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = BestEffortAppender(self.path)  # a full disk drops records (counted), it stops no role
        self.exposed = None
        if prometheus:
            from common.metrics.prometheus import serve
            self.exposed = serve(prometheus, role or (self.path.stem if self.path else "role"), rank)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None and self.exposed is None:
            return
        dropped = {"records_dropped": self._f.dropped} if self._f is not None and self._f.dropped else {}
        line = json.dumps({"time": time.time(), **record, **process_memory(), **dropped}, default=_jsonable)
        if self.exposed is not None:
            self.exposed.update(json.loads(line))  # plain types, as a reader of the file would get them
        if self._f is not None:
            self._f.write(line + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_memory() -> dict[str, float]:
    """This process's resident set now and at its peak, in MB: every role's metrics record carries them, so a
    role that grows with the run's length shows it (roles run as threads of one process report that process)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):  # not Linux: the peak alone
        rss = 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rss_mb": round(rss / 2**20, 1), "peak_rss_mb": round(peak / 2**20, 1)}


class TimeSplit:
    """A loop's wall time split by what it was doing: ``enter(state)`` charges the time since the previous call to
    the state being left. ``seconds()`` are cumulative per state, the current one included; a role reports them
    so an operator can tell waiting (idle) from working, and a bench can bound a run by its busy time."""

    def __init__(self, state: str):
        self.state = state
        self._since = time.monotonic()
        self._seconds: collections.Counter[str] = collections.Counter()

    def enter(self, state: str) -> None:
        now = time.monotonic()
        self._seconds[self.state] += now - self._since
        self.state, self._since = state, now

    def seconds(self) -> dict[str, float]:
        out = dict(self._seconds)
        out[self.state] = out.get(self.state, 0.0) + time.monotonic() - self._since
        return out


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


class Histogram:
    """Counts of values in buckets ``[b_i, b_{i+1})``; the last bucket is open-ended."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = list(bounds)
        self.counts = [0] * len(self.bounds)

    def add(self, value: float, n: int = 1) -> None:
        idx = 0
        for i, b in enumerate(self.bounds):
            if value >= b:
                idx = i
        self.counts[idx] += n

    def as_dict(self) -> dict[str, int]:
        labels = [f"{b:g}" for b in self.bounds]
        labels[-1] += "+"
        return dict(zip(labels, self.counts))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
