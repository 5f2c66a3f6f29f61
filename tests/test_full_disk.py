"""What a role writes besides its durable state, on a full disk: log lines and metrics records are dropped, counted,
and the files taken up again once space returns; audit events are held and written late, never dropped.
``/dev/full`` fails every write with ``ENOSPC``; a symlink to it, pointed back at a real file, is a disk that fills
and then frees. (The spill log's rules: ``tests/test_spill_model.py``; a checkpoint's: ``tests/test_learner.py``.)"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import common.appendfile as appendfile
import common.audit as audit
from common import log as L
from common.metrics.writer import MetricsWriter

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def full_then_freed(tmp_path: Path, name: str) -> tuple[Path, callable]:
    """A path that is a full disk until ``free()``; then it is a file of its own."""
    path = tmp_path / name
    path.symlink_to("/dev/full")

    def free() -> None:
        path.unlink()
        path.touch()

    return path, free


def lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # (a torn line: readers skip it)
    return out


def test_log_lines_on_a_full_disk_are_dropped_counted_and_the_file_taken_up_again(tmp_path, monkeypatch):
    monkeypatch.setattr(appendfile, "REOPEN_AFTER_S", 0.0)
    path, free = full_then_freed(tmp_path, "learner-0.jsonl")
    log = L.setup("learner", "run", 0, tmp_path, "info", quiet=True)
    for i in range(3):
        log.info("step", n=i)  # nothing raises out of a log call
    free()
    log.info("step", n=3)
    (written,) = lines(path)
    assert written["n"] == 3 and written["log_lines_dropped"] == 3
    log.info("step", n=4)
    assert "log_lines_dropped" not in lines(path)[-1]
    L.setup("test", "test", 0, None, "warning", quiet=True)


def test_metrics_records_on_a_full_disk_are_dropped_counted_and_the_file_taken_up_again(tmp_path, monkeypatch):
    monkeypatch.setattr(appendfile, "REOPEN_AFTER_S", 0.0)
    path, free = full_then_freed(tmp_path, "broker.jsonl")
    metrics = MetricsWriter(path)
    metrics.write({"step": 1})
    metrics.write({"step": 2})
    assert metrics._f.failures == 2
    free()
    metrics.write({"step": 3})
    metrics.close()
    (written,) = lines(path)
    assert written["step"] == 3 and written["records_dropped"] == 2


def test_a_best_effort_file_waits_before_it_tries_a_full_disk_again(tmp_path):
    path, free = full_then_freed(tmp_path, "x.jsonl")
    f = appendfile.BestEffortAppender(path)
    assert not f.write("a\n") and not f.write("b\n")
    free()
    assert not f.write("c\n"), "within REOPEN_AFTER_S of the failure: dropped without trying"
    assert f.failures == 1 and f.dropped == 3


def test_audit_events_on_a_full_disk_are_held_in_order_and_written_once_space_returns(tmp_path, monkeypatch):
    monkeypatch.setattr(audit, "AUDIT_RETRY_S", 0.0)
    path = tmp_path / "broker.jsonl"
    trail = audit.AuditLog(path)
    trail.write("acked", g="g1")
    real_write, full = os.write, {"on": True}

    def disk(fd, data):
        if full["on"] and fd == trail._fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(audit.os, "write", disk)
    trail.write("acked", g="g2")
    trail.write_many([("delivered", {"gs": ["g1", "g2"]}), ("consumed", {"gs": ["g1"]})])
    assert trail.write_failures == 2 and trail.pending_bytes > 0
    assert [e["e"] for e in audit.read_events(path)] == ["acked"]
    full["on"] = False
    trail.write("consumed", gs=["g2"])
    trail.close()
    assert [(e["e"], e.get("g", e.get("gs"))) for e in audit.read_events(path)] == [
        ("acked", "g1"), ("acked", "g2"), ("delivered", ["g1", "g2"]), ("consumed", ["g1"]), ("consumed", ["g2"])]


def test_an_audit_that_cannot_be_kept_stops_its_role(tmp_path, monkeypatch):
    """Past its bound in memory, or at close, events that cannot be written raise: the trail proves the run."""
    monkeypatch.setattr(audit, "AUDIT_RETRY_S", 0.0)
    monkeypatch.setattr(audit, "AUDIT_PENDING_MAX_BYTES", 200)
    trail = audit.AuditLog(tmp_path / "learner.jsonl")
    real_write = os.write

    def full(fd, data):
        if fd == trail._fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(audit.os, "write", full)
    trail.write("trained", gs=["a" * 32], v=1)  # held
    with pytest.raises(OSError, match="audit events could not be written"):
        trail.write("trained", gs=["b" * 32] * 6, v=2)
    with pytest.raises(OSError, match="audit events could not be written"):
        trail.close()


def test_a_best_effort_file_that_cannot_even_be_created_waits_and_loses_no_count(tmp_path, monkeypatch):
    """On a full disk a new log file may not be creatable at all: the role starts anyway (the old writer raised
    out of its start-up), the lines meanwhile are counted as dropped, and the file is made once it can be."""
    monkeypatch.setattr(appendfile, "REOPEN_AFTER_S", 0.0)
    blocked = tmp_path / "not-yet"
    blocked.write_text("")  # a file where the log's directory should be: creating the log fails
    path = blocked / "actor-0.jsonl"
    f = appendfile.BestEffortAppender(path)
    assert f.failures == 1 and f.dropped == 0, "nothing was lost yet"
    assert not f.write("a\n") and f.dropped == 1
    blocked.unlink()
    blocked.mkdir()
    assert f.write("b\n") and f.dropped == 0
    f.close()
    assert path.read_text() == "\nb\n"
