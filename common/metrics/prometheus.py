"""Prometheus ``/metrics`` for a role: the role's newest metric record, exposed as it was written.

A role already keeps its counters, gauges and histograms and writes them as one JSONL record every few seconds
(``common.metrics.writer.MetricsWriter``); with ``prometheus: HOST:PORT`` in the role's config section, the same writer
also serves that newest record over HTTP (``prometheus_client``), so what an operator scrapes is exactly what
the run directory records. Mapping, for a role ``broker``:

- a number ``queue_depth`` -> gauge ``computerrl_broker_queue_depth``;
- a number under ``counters`` (cumulative by contract) -> counter ``computerrl_broker_<name>_total``;
- a nested group of named numbers ``{"weights": {"round_s": 1.2}}`` -> ``computerrl_broker_weights_round_s``;
- a histogram-like group whose keys are not names (``lag_hist: {"0": 5, "16+": 1}``) -> one gauge with a
  ``key`` label (``computerrl_broker_lag_hist{key="16+"}``);
- every series carries ``rank``; strings, lists, NaN are left out.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterator

from common.metrics.records import numeric_fields

_NAME = re.compile(r"[^a-zA-Z0-9_]")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _metric_name(*parts: str) -> str:
    return _NAME.sub("_", "_".join(p for p in parts if p))


def series(record: dict) -> Iterator[tuple[str, str, dict[str, str], float]]:
    """(kind gauge|counter, metric name without the namespace, labels, value) for every measurement of the
    record (``common.metrics.records.numeric_fields``): the first key that is not a name (a histogram's bucket) becomes
    the ``key`` label, the keys before it the name."""
    for path, value in numeric_fields(record):
        if path[0] == "counters" and len(path) == 2:
            yield "counter", _metric_name(path[1]), {}, value
            continue
        cut = next((i for i, k in enumerate(path) if i and not _IDENT.match(k)), len(path))
        labels = {"key": "/".join(path[cut:])} if cut < len(path) else {}
        yield "gauge", _metric_name(*path[:cut]), labels, value


class RecordCollector:
    """A ``prometheus_client`` collector over the newest record (set by ``update``)."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self.record: dict = {}
        self.lock = threading.Lock()

    def update(self, record: dict) -> None:
        with self.lock:
            self.record = record

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.lock:
            record = self.record
        families: dict[tuple[str, str], Any] = {}
        for kind, name, labels, value in series(record):
            full = f"computerrl_{_metric_name(self.role)}_{name}"
            fam = families.get((kind, full))
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[(kind, full)] = cls(full, f"{self.role} {name} (from its metrics record)",
                                                   labels=["rank", *labels])
            fam.add_metric([str(self.rank), *labels.values()], value)
        yield from families.values()


def serve(address: str, role: str, rank: int) -> RecordCollector:
    """Start serving ``/metrics`` on ``HOST:PORT`` (the port plus ``rank``, so ranked roles share one setting) in a
    daemon thread; a clear error when the package is missing or the port is taken."""
    try:
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
    except ImportError as exc:
        raise RuntimeError(f"{role}.prometheus is set but prometheus_client is not installed: "
                           "pip install 'computerrl[tracking]'") from exc
    host, _, port = address.rpartition(":")
    collector = RecordCollector(role, rank)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open files: what operators chart
    try:
        start_http_server(int(port) + rank, addr=host or "0.0.0.0", registry=registry)
    except OSError as exc:
        raise RuntimeError(f"{role}.prometheus {address}: cannot serve on port {int(port) + rank}: {exc}") from exc
    return collector


def check_address(address: str, key: str) -> None:
    """Config check of a ``prometheus`` setting: empty (off) or HOST:PORT."""
    if not address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{key} must be HOST:PORT (e.g. 0.0.0.0:9400) or empty, not {address!r}")
