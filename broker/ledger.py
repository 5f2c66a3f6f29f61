"""The broker's bookkeeping, free of sockets and files: admission, tickets and leases, queue, batches.

Notation (docs/architecture.md): ``v`` learner version, ``B`` groups per train step, ``η`` staleness bound.

Admission: a ticket is granted only while ``accepted + running < (η + v + 1)·B``. ``accepted`` counts
groups accepted since version 0 that are trained, handed to the learner, or queued; the broker does not
see the learner's history, so it counts the ``v·B`` groups behind version ``v`` as trained and adds what
it holds itself (groups in delivered-but-untrained batches, and queued groups). Dropped groups leave
``accepted``, so a drop frees capacity instead of starving the learner.

Bound: a batch trains at ``train_version`` (the learner version it will be applied at); a group whose
oldest token has ``train_version − v_b > η`` is dropped and counted, never trained.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from common.group_rules import too_stale


def admission_capacity(version: int, groups_per_batch: int, eta: int, accepted: int, running: int) -> int:
    """How many more tickets may be granted now: ``(η + v + 1)·B − (accepted + running)``, at least 0."""
    return max(0, (eta + version + 1) * groups_per_batch - (accepted + running))


@dataclass
class TicketInfo:
    ticket_id: str
    request_id: str
    task_id: str
    holder: bytes
    issued_at: float
    version: int
    seq: int = 0


@dataclass
class QueuedGroup:
    """A durable, acked group waiting for a batch. ``frames`` is None when it waits on disk only."""

    group_id: str
    task_id: str
    behavior_version_min: int
    nbytes: int
    location: Any = None
    frames: list | None = None


class GroupQueue:
    """Queued groups served oldest behaviour version first, then in ticket-grant order.

    Admission counts a ticket against every ticket granted before it; serving in that order (not in
    arrival order, where a late slow rollout would sit behind newer ones) keeps a group's lag within η
    unless its own rollout outlived η learner steps. A group can leave from the middle (``discard``: the
    learner settled a copy it had before a broker restart); its heap entry is skipped when it surfaces.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, QueuedGroup]] = []
        self._seq = itertools.count()
        self._live: dict[str, QueuedGroup] = {}

    def push(self, g: QueuedGroup, order: int | None = None) -> None:
        if g.group_id in self._live:
            return
        self._live[g.group_id] = g
        n = next(self._seq)  # also the tie-break: entries never compare the groups themselves
        heapq.heappush(self._heap, (g.behavior_version_min, n if order is None else order, n, g))

    def pop(self) -> tuple[QueuedGroup, int]:
        while True:
            _, order, _, g = heapq.heappop(self._heap)
            if self._live.get(g.group_id) is g:
                del self._live[g.group_id]
                return g, order

    def discard(self, group_id: str) -> QueuedGroup | None:
        return self._live.pop(group_id, None)

    def take(self, group_ids: Iterable[str]) -> list[tuple[QueuedGroup, int]]:
        """Remove these groups (the ones queued) with their serving order."""
        wanted = {gid for gid in group_ids if gid in self._live}
        out = []
        for _, order, _, g in sorted(self._heap, key=lambda e: e[:3]):  # serving order; a group taken and queued
            if g.group_id in wanted and self._live.get(g.group_id) is g:  # again has a dead entry beside its live one
                del self._live[g.group_id]
                out.append((g, order))
        return out

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return iter(list(self._live.values()))

    def newest_first(self) -> list[QueuedGroup]:
        return [g for _, _, _, g in sorted(self._heap, key=lambda e: e[:3], reverse=True)
                if self._live.get(g.group_id) is g]


@dataclass
class DeliveredBatch:
    """A batch handed to the learner; its groups stay the broker's until the learner commits them."""

    batch_id: str
    train_version: int
    groups: list[QueuedGroup]
    holder: bytes
    orders: list[int] = field(default_factory=list)
    committed: set[str] = field(default_factory=set)


@dataclass
class Ledger:
    groups_per_batch: int
    eta: int
    version: int = 0
    running: dict[str, TicketInfo] = field(default_factory=dict)
    queue: GroupQueue = field(default_factory=GroupQueue)
    delivered: dict[str, DeliveredBatch] = field(default_factory=dict)
    delivered_group: dict[str, str] = field(default_factory=dict)
    """group id -> id of the delivered batch that holds it, until committed or requeued"""
    last_train_version: int = -1
    committing: int = 0
    """groups received and being made durable: not yet queued, no longer running"""
    counters: collections.Counter = field(default_factory=collections.Counter)
    _ids: Any = field(default_factory=lambda: itertools.count())

    # ----- admission -------------------------------------------------------------------------

    @property
    def accepted(self) -> int:
        return (self.version + self._untrained_batches()) * self.groups_per_batch + len(self.queue) + self.committing

    def _untrained_batches(self) -> int:
        # Train versions handed out at or above v have not been applied yet.
        return max(0, self.last_train_version - self.version + 1)

    def capacity(self) -> int:
        return admission_capacity(self.version, self.groups_per_batch, self.eta, self.accepted, len(self.running))

    def set_version(self, version: int) -> None:
        rewound = version < self.version
        self.version = version
        if rewound:
            # The learner resumed from an older checkpoint: its version sequence is the truth. The train versions
            # handed out past it went with the batches its death sent back to the queue: the next batch trains at
            # this version again. (Kept, they made the broker form batches for versions the learner was not at,
            # dropping its requeued groups as stale, and count phantom untrained batches against admission: once
            # more versions than η were lost, no ticket was ever granted again.)
            self.counters["version_rewound"] += 1
            self._recount_train_versions()
        if self.last_train_version < version - 1:
            self.last_train_version = version - 1

    def _recount_train_versions(self) -> None:
        """The last train version handed out, from what is still handed out: the batches still delivered, else none
        past the current version (after a requeue or a rewind took the others back)."""
        self.last_train_version = max([self.version - 1] + [b.train_version for b in self.delivered.values()])

    # ----- tickets and leases ----------------------------------------------------------------

    def grant(self, request_id: str, task_id: str, holder: bytes, now: float) -> TicketInfo:
        """A ticket issued at ``now`` (never earlier than the last one: lease expiry reads them in this order)."""
        seq = next(self._ids)
        ticket = TicketInfo(f"t{seq}-{request_id}", request_id, task_id, holder, now, self.version, seq)
        self.running[ticket.ticket_id] = ticket
        self.counters["tickets_issued"] += 1
        return ticket

    def settle(self, ticket_id: str) -> TicketInfo | None:
        """A group arrived for ``ticket_id``: the ticket stops counting as running."""
        ticket = self.running.pop(ticket_id, None)
        if ticket is None:
            self.counters["groups_without_running_ticket"] += 1
        return ticket

    def reclaim(self, holder: bytes | None = None, older_than: float | None = None) -> list[TicketInfo]:
        """Take back tickets of a dead holder, or tickets whose lease ran out; their tasks go out again.

        Lease expiry runs every broker turn: ``running`` is in grant order, so it reads only the expired tickets
        and the first live one, not every ticket of thousands of actors."""
        if holder is not None:
            gone = [t for t in self.running.values() if t.holder == holder]
        else:
            gone = []
            for t in self.running.values():
                if older_than is None or t.issued_at >= older_than:
                    break
                gone.append(t)
        for t in gone:
            del self.running[t.ticket_id]
        self.counters["tickets_reclaimed"] += len(gone)
        return gone

    # ----- queue and batches -----------------------------------------------------------------

    def next_train_version(self) -> int:
        return max(self.version, self.last_train_version + 1)

    def too_stale(self, behavior_version_min: int) -> bool:
        """Already beyond the bound for the earliest batch it could join: it will only get staler."""
        return too_stale(self.next_train_version(), behavior_version_min, self.eta)

    def enqueue(self, group: QueuedGroup, order: int | None = None) -> None:
        """Queue a durable group; ``order`` is its ticket's grant sequence when known."""
        self.queue.push(group, order)
        self.counters["groups_accepted"] += 1

    def take_batch(self, holder: bytes) -> tuple[DeliveredBatch | None, list[QueuedGroup]]:
        """Form the next batch of exactly B groups, dropping stale ones; (None, drops) if too few."""
        train_version = self.next_train_version()
        taken: list[tuple[QueuedGroup, int]] = []
        dropped: list[QueuedGroup] = []
        while self.queue and len(taken) < self.groups_per_batch:
            g, order = self.queue.pop()
            if too_stale(train_version, g.behavior_version_min, self.eta):
                dropped.append(g)
            else:
                taken.append((g, order))
        self.counters["dropped_stale"] += len(dropped)
        if len(taken) < self.groups_per_batch:
            for g, order in taken:
                self.queue.push(g, order)
            return None, dropped
        batch = DeliveredBatch(f"b{train_version}-{next(self._ids)}", train_version, [g for g, _ in taken], holder,
                               [o for _, o in taken])
        self.delivered[batch.batch_id] = batch
        for g in batch.groups:
            self.delivered_group[g.group_id] = batch.batch_id
        self.last_train_version = train_version
        self.counters["batches_delivered"] += 1
        self.counters["groups_delivered"] += len(taken)
        return batch, dropped

    def commit(self, group_ids: Iterable[str]) -> tuple[list[QueuedGroup], int]:
        """The learner's durable checkpoint settles these groups: they leave for good, from a delivered
        batch or (re-queued by a broker restart) from the queue. Returns (groups found, ids unknown here —
        already consumed before, a retried Commit)."""
        found, unknown = [], 0
        for gid in group_ids:
            batch_id = self.delivered_group.pop(gid, None)
            if batch_id is not None:
                batch = self.delivered[batch_id]
                batch.committed.add(gid)
                found.append(next(g for g in batch.groups if g.group_id == gid))
                if len(batch.committed) == len(batch.groups):
                    del self.delivered[batch_id]
                continue
            g = self.queue.discard(gid)
            if g is not None:
                found.append(g)
            else:
                unknown += 1
        self.counters["groups_committed"] += len(found)
        return found, unknown

    def unsend(self, batch: DeliveredBatch, gone: Iterable[str]) -> list[QueuedGroup]:
        """A batch just formed that cannot be sent (a group of it unreadable on disk): the groups in ``gone`` leave
        for good, the others go back to the queue in their order, and its train version is handed out again.
        Returns the groups that left."""
        gone = set(gone)
        del self.delivered[batch.batch_id]
        left = []
        for g, order in zip(batch.groups, batch.orders):
            self.delivered_group.pop(g.group_id, None)
            if g.group_id in gone:
                left.append(g)
            else:
                self.queue.push(g, order)
        self.counters["batches_delivered"] -= 1
        self.counters["groups_delivered"] -= len(batch.groups)
        self._recount_train_versions()
        return left

    def requeue_delivered(self, holder: bytes | None = None) -> list[QueuedGroup]:
        """The learner restarted or died: whatever it had not committed (received, trained since its last
        checkpoint, or lost on the wire) goes back to the queue and is delivered again."""
        back: list[QueuedGroup] = []
        for b in [b for b in self.delivered.values() if holder is None or b.holder == holder]:
            del self.delivered[b.batch_id]
            for g, order in zip(b.groups, b.orders):
                if g.group_id not in b.committed:
                    self.delivered_group.pop(g.group_id, None)
                    self.queue.push(g, order)
                    back.append(g)
            self.counters["batches_requeued"] += 1
        if back:
            self._recount_train_versions()
            self.counters["groups_requeued"] += len(back)
        return back

    def hold(self, holder: bytes, group_ids: Iterable[str],
             untrained_batches: int) -> tuple[DeliveredBatch | None, int]:
        """A learner that re-handshook still holds these groups (``Holding``): the ones its handshake sent back to
        the queue are its again, as one delivered batch, and the ``untrained_batches`` it has not trained yet
        count as handed out (train versions ``v .. v + untrained_batches - 1``). Returns (that batch, how many ids
        were not queued: committed meanwhile, or never here)."""
        ids = list(group_ids)
        taken = self.queue.take(ids)
        untrained = max(0, untrained_batches)
        self.last_train_version = max(self.last_train_version, self.version + untrained - 1)
        if not taken:
            return None, len(ids)
        batch = DeliveredBatch(f"h{self.version}-{next(self._ids)}", self.version + untrained - 1,
                               [g for g, _ in taken], holder, [o for _, o in taken])
        self.delivered[batch.batch_id] = batch
        for g in batch.groups:
            self.delivered_group[g.group_id] = batch.batch_id
        self.counters["groups_held_again"] += len(taken)
        return batch, len(ids) - len(taken)

    def queued_bytes(self) -> int:
        return sum(g.nbytes for g in self.queue)

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "queue_depth": len(self.queue),
            "running": len(self.running),
            "accepted": self.accepted,
            "capacity": self.capacity(),
            "batches_uncommitted": len(self.delivered),
            "groups_uncommitted": len(self.delivered_group),
            "next_train_version": self.next_train_version(),
        }
