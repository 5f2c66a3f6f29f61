"""``reconcile``: the audit of a run directory — its broker's and learner's audit trails (``common/audit.py``)
and the groups its broker's spill log still holds, reconciled by group id. It lives here, above both, because the
spill log's reader is the broker's."""

from __future__ import annotations

from pathlib import Path

from broker.spill import SpillLog
from common.audit import Reconciliation, read_events, reconcile_events


def reconcile(run_dir: str | Path) -> Reconciliation:
    """Every acked group's fate in the run at ``run_dir``: trained once, dropped with a reason, still queued, or
    lost (and any trained twice)."""
    root = Path(run_dir)
    spill_dir = root / "spill"
    queued = {g for g, _ in SpillLog.scan(spill_dir).groups} if spill_dir.is_dir() else set()
    return reconcile_events(read_events(root / "audit" / "broker.jsonl"),
                            read_events(root / "audit" / "learner.jsonl"), queued)
