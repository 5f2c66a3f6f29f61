"""The group audit trail: lifecycle events of every trajectory group, appended by the broker and the learner
to ``<run>/audit/<role>.jsonl``, and ``reconcile_events``, which answers "was any acked group lost or trained
twice?" (``launch/audit.py`` runs it on a run directory).

One JSON object per line, short keys: ``e`` event, ``t`` unix time, ``g`` one group id or ``gs`` several,
``r`` reason, ``v`` the learner version the event happened at. Lines go to the file with one ``write`` each
(O_APPEND), so a ``kill -9`` leaves every line written before it and at most a torn last line, which the
reader skips. The files are only appended to; restarts append to the same files.

Broker events: ``start`` (restart count, groups recovered from the spill log), ``acked`` (group durable and
acknowledged: task, actor, behaviour versions), ``recovered`` (groups found in the spill log at start: they
were durable, so acked or about to be), ``dropped`` (a counted reason: stale, incomplete, zero_variance),
``delivered`` (in batch ``b`` for train version ``v``), ``requeued`` (the learner restarted before committing
them), ``consumed`` (a learner Commit made them leave the broker for good).

Learner events: ``resume`` (the checkpoint version it continues from, 0 for a fresh start), ``trained``
(groups used by the step that produced version ``v``), ``dropped`` (by the learner, with a reason),
``checkpoint`` (version ``v`` is durable: it covers every settlement at or below ``v``).

Exactly-once, as ``reconcile_events`` checks it: a learner settlement counts only once a checkpoint covers it; a
``resume`` from version ``v`` keeps the settlements at or below ``v`` and discards the rest (the learner
rolled back and forgot them). Every acked group must then be trained exactly once, dropped with a
reason, or still waiting in the broker's spill log (the run stopped before its turn came).
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from common.jsonl import read_jsonl


AUDIT_PENDING_MAX_BYTES = 256 << 20  # events held while the disk is full; past this the role stops (see write_many)
AUDIT_RETRY_S = 1.0  # while events are held, how often writing them is tried again


class AuditLog:
    """Appends events for one role; ``None`` path makes every call a no-op (auditing is off).

    The trail is what proves a run lost nothing, so a full disk must not drop events: those a write could not take
    are held in memory, in order, and written ahead of the next ones once the disk takes them again (tried at most
    every ``AUDIT_RETRY_S``). Past ``AUDIT_PENDING_MAX_BYTES`` held, the write raises: a role that cannot keep its
    trail stops, and its restart resumes from durable state."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._fd: int | None = None
        self._pending = b""  # events not yet written (a full disk), oldest first
        self._retry_at = 0.0
        self.write_failures = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        self.write_many([(event, fields)])

    def write_many(self, events: Iterable[tuple[str, dict]]) -> None:
        """Several events in one ``write`` (a kill leaves all of them or none but a torn tail)."""
        if self._fd is None:
            return
        now = round(time.time(), 3)
        data = "".join(json.dumps({"e": e, "t": now, **f}, separators=(",", ":")) + "\n" for e, f in events)
        if data:
            self._pending += data.encode()
        if self._pending and time.monotonic() >= self._retry_at:
            self._write_pending()

    def _write_pending(self, final: bool = False) -> None:
        pending = self._pending
        try:
            while pending:
                pending = pending[os.write(self._fd, pending):]
        except OSError as exc:
            self.write_failures += 1
            self._retry_at = time.monotonic() + AUDIT_RETRY_S
            if final or len(pending) > AUDIT_PENDING_MAX_BYTES:
                raise OSError(exc.errno, f"{len(pending)} bytes of audit events could not be written to "
                                         f"{self.path}: {exc.strerror}") from exc
        finally:
            self._pending = pending

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        if self._fd is not None:
            try:
                if self._pending:
                    self._write_pending(final=True)
            finally:
                os.close(self._fd)
                self._fd = None


def read_events(path: Path) -> Iterator[dict]:
    """Events of one file in order; a torn or garbled line is skipped."""
    return (ev for ev in read_jsonl(path) if "e" in ev)


def _ids(ev: dict) -> list[str]:
    return ev["gs"] if "gs" in ev else [ev["g"]] if "g" in ev else []


@dataclass
class Reconciliation:
    acked: int = 0
    trained_once: int = 0
    trained_twice: list[str] = field(default_factory=list)
    dropped: collections.Counter = field(default_factory=collections.Counter)
    queued: int = 0
    lost: list[str] = field(default_factory=list)
    rolled_back: int = 0
    """learner settlements discarded by a resume (their groups were delivered again)"""
    unrecorded: list[str] = field(default_factory=list)
    """trained though no ack or recovery was ever recorded: a gap in the trail itself"""
    learner_starts: int = 0
    broker_starts: int = 0
    out_of_order: int = 0
    """learner steps whose version did not follow the one before without a resume between: two learners writing one
    run's trail at once (``common/claims.py`` prevents it where the file system locks)"""
    acked_ids: set[str] = field(default_factory=set)
    """every group the broker recorded as acked (or recovered, or dropped on receipt)"""
    damaged: list[str] = field(default_factory=list)
    """lost groups whose records a restarted broker found damaged in its spill log (bytes changed on disk), by the
    id the record still stated; a damaged stretch that states none leaves its groups lost without a reason"""

    @property
    def ok(self) -> bool:
        return not self.lost and not self.trained_twice and not self.unrecorded and not self.out_of_order

    def as_dict(self) -> dict:
        return {"acked": self.acked, "trained_once": self.trained_once, "trained_twice": len(self.trained_twice),
                "dropped": dict(self.dropped), "dropped_total": sum(self.dropped.values()), "queued": self.queued,
                "lost": len(self.lost), "unrecorded": len(self.unrecorded), "rolled_back_settlements": self.rolled_back,
                "learner_starts": self.learner_starts, "broker_starts": self.broker_starts,
                "learner_steps_out_of_order": self.out_of_order, "lost_damaged_on_disk": len(self.damaged),
                "lost_ids": self.lost[:20], "trained_twice_ids": self.trained_twice[:20], "ok": self.ok}

    def table(self) -> str:
        rows = [("acked groups", self.acked), ("trained once", self.trained_once)]
        rows += [(f"dropped: {r}", n) for r, n in sorted(self.dropped.items())]
        rows += [("queued at the broker (not yet trained)", self.queued),
                 ("LOST", len(self.lost)),
                 *([("  of them damaged on disk (spill_record_damaged)", len(self.damaged))]
                   if self.damaged else []),
                 ("TRAINED TWICE", len(self.trained_twice)),
                 ("trained without an ack record", len(self.unrecorded)),
                 ("learner settlements rolled back", self.rolled_back), ("learner starts (a resume is one)", self.learner_starts),
                 ("broker starts", self.broker_starts),
                 ("LEARNER STEPS OUT OF ORDER (two learners at once)", self.out_of_order)]
        width = max(len(r[0]) for r in rows)
        out = [f"{name:<{width}}  {n:>7}" for name, n in rows]
        if self.lost:
            out.append("lost: " + ", ".join(self.lost[:10]) + (" ..." if len(self.lost) > 10 else ""))
        if self.trained_twice:
            out.append("trained twice: " + ", ".join(self.trained_twice[:10]))
        if self.dropped.get("step_crashed"):
            out.append("step_crashed: groups whose steps killed the learner, kept in the run's quarantine/ "
                       "(computerrl episodes RUN shows them; computerrl replay-step RUN GROUP_ID trains one alone)")
        return "\n".join(out)


def learner_settlements(events: Iterable[dict]) -> tuple[list[tuple[str, str]], int, int, int]:
    """The durable settlements of a learner's event stream: ([(group, "trained" | reason)], discarded, resumes,
    steps out of order). One learner's steps each produce the next version, and it starts (a ``resume``) before it
    trains; a step whose version is not above the last one's since then was another learner's."""
    durable: list[tuple[str, str]] = []
    pending: list[tuple[int, str, str]] = []  # (version, group, outcome) not yet covered by a checkpoint
    discarded = resumes = out_of_order = 0
    last_step = None  # version of the last step since the last resume
    for ev in events:
        e = ev["e"]
        if e == "trained":
            v = int(ev.get("v", 0))
            if last_step is not None and v <= last_step:
                out_of_order += 1
            last_step = v if last_step is None else max(last_step, v)
        elif e == "resume":
            last_step = int(ev.get("v", 0))
        if e in ("trained", "dropped"):
            outcome = "trained" if e == "trained" else str(ev.get("r", "?"))
            pending.extend((int(ev.get("v", 0)), g, outcome) for g in _ids(ev))
        elif e in ("checkpoint", "resume"):
            v = int(ev.get("v", 0))
            durable.extend((g, o) for pv, g, o in pending if pv <= v)
            later = [p for p in pending if p[0] > v]
            if e == "resume":
                resumes += 1
                discarded += len(later)
                pending = []
            else:
                pending = later
    return durable, discarded, resumes, out_of_order


def group_fates(broker_events: Iterable[dict], learner_events: Iterable[dict]) -> dict[str, str]:
    """What became of each group, in words for people (the episode viewer): "trained at version k", "dropped by
    the learner (reason)", "dropped by the broker (reason)", or "queued" for a group acked and not yet settled. The
    latest learner settlement of a group wins (a resume may settle it again)."""
    fates: dict[str, str] = {}
    for ev in broker_events:
        if ev["e"] in ("acked", "recovered"):
            for g in _ids(ev):
                fates.setdefault(g, "queued")
        elif ev["e"] == "dropped":
            for g in _ids(ev):
                fates[g] = f"dropped by the broker ({ev.get('r', '?')})"
    for ev in learner_events:
        if ev["e"] == "trained":
            for g in _ids(ev):
                fates[g] = f"trained at version {ev.get('v', '?')}"
        elif ev["e"] == "dropped":
            for g in _ids(ev):
                fates[g] = f"dropped by the learner ({ev.get('r', '?')})"
    return fates


def reconcile_events(broker_events: Iterable[dict], learner_events: Iterable[dict],
                     queued: set[str]) -> Reconciliation:
    """Every acked group's fate from the broker's and the learner's event streams and the ids still queued in the
    broker's spill log (``launch/audit.py`` reads them from a run directory)."""
    out = Reconciliation()
    acked: set[str] = set()
    broker_drop: dict[str, str] = {}
    damaged: set[str] = set()
    for ev in broker_events:
        e = ev["e"]
        if e in ("acked", "recovered"):
            acked.update(_ids(ev))
        elif e == "damaged":
            damaged.update(_ids(ev))
        elif e == "dropped":
            for g in _ids(ev):
                acked.add(g)
                broker_drop.setdefault(g, str(ev.get("r", "?")))
        elif e == "start":
            out.broker_starts += 1
    durable, out.rolled_back, out.learner_starts, out.out_of_order = learner_settlements(learner_events)
    trained: collections.Counter = collections.Counter()
    learner_drop: dict[str, str] = {}
    for g, outcome in durable:
        if outcome == "trained":
            trained[g] += 1
        else:
            learner_drop.setdefault(g, outcome)
    out.acked, out.acked_ids = len(acked), acked
    for g in sorted(acked):
        n = trained.get(g, 0)
        if n >= 2 or (n == 1 and g in learner_drop):
            out.trained_twice.append(g)
        elif n == 1:
            out.trained_once += 1
        elif g in learner_drop:
            out.dropped[learner_drop[g]] += 1
        elif g in broker_drop:
            out.dropped[broker_drop[g]] += 1
        elif g in queued:
            out.queued += 1
        else:
            out.lost.append(g)
            if g in damaged:
                out.damaged.append(g)
    out.unrecorded = sorted(set(trained) - acked)
    return out
