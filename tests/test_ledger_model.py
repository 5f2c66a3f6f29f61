"""The broker's ledger against a model of its actors and its learner, driven at random.

Each seed draws B, η and the learner's prefetch, then a few thousand events: actors are granted tickets while there
is capacity, their rollouts end at random (their groups arrive, stale ones are dropped at intake), actors die and
leases run out (tickets reclaimed; a rollout may still arrive), the learner takes batches, trains them one version
at a time and commits what it trained at its checkpoints, dies (it resumes from its last checkpoint: everything
uncommitted goes back to the queue, the version rewinds), or loses its link and comes back holding what it had;
the broker restarts from its spill log.

After every event, by group id: each group that arrived is in exactly one place (queued, in a batch the learner
holds, committed, or dropped with a reason); the learner holds exactly the groups the ledger says it does; no
group is committed twice; every batch has B distinct groups, none past η at the version it is delivered for.
Without learner failures the learner itself never finds a group past η (the broker's train versions are the
learner's). At the end the actors stop and the learner drains the queue: every group is committed or dropped, but
for fewer than B left queued.

``COMPUTERRL_LEDGER_SEEDS=N`` runs N seeds instead of the quick tier's few (a soak)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

from broker.ledger import DeliveredBatch, Ledger, QueuedGroup
from common.group_rules import too_stale

SEEDS = int(os.environ.get("COMPUTERRL_LEDGER_SEEDS", "0")) or 40
LEARNER = b"learner"


@dataclass
class Learner:
    """What the learner holds: batches not yet trained, groups trained since its last checkpoint."""

    version: int = 0
    checkpoint: int = 0
    inbox: list[DeliveredBatch] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)  # settled (trained or dropped) since the last checkpoint

    def held(self) -> set[str]:
        return {g.group_id for b in self.inbox for g in b.groups} | set(self.trained)


class Model:
    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        self.eta, self.prefetch = rng.choice([0, 1, 2, 4]), rng.choice([1, 2, 3])
        self.led = Ledger(groups_per_batch=rng.choice([1, 2, 4, 8]), eta=self.eta)
        self.failures = rng.random() < 0.7
        self.learner = Learner()
        self.rollouts: list[tuple[object, int, bytes]] = []  # (ticket, behaviour version, actor)
        self.now, self.lease = 0.0, rng.choice([5.0, 50.0])
        self.arrived: set[str] = set()
        self.place: dict[str, str] = {}  # group id -> dropped_intake | dropped_batch | committed (else: ledger's)
        self.learner_stale = 0
        self.broker_starts = 1
        self.where = f"seed {seed}, B {self.led.groups_per_batch}, eta {self.eta}, prefetch {self.prefetch}"

    # ----- actors --------------------------------------------------------------------------------

    def grant(self) -> None:
        if self.led.capacity() > 0:
            actor = f"a{self.rng.randrange(4)}".encode()
            # an actor samples with the weights it has: the current version or one behind
            self.rollouts.append((self.led.grant(f"r{self.now}", "t", actor, self.now),
                                  max(0, self.led.version - self.rng.choice([0, 0, 1])), actor))

    def arrive(self) -> None:
        if not self.rollouts:
            return
        ticket, bv, _ = self.rollouts.pop(self.rng.randrange(len(self.rollouts)))
        gid = f"g-{ticket.ticket_id}"
        assert gid not in self.arrived
        self.arrived.add(gid)
        held = self.led.settle(ticket.ticket_id)
        if self.led.too_stale(bv):
            self.place[gid] = "dropped_intake"
        else:
            self.led.enqueue(QueuedGroup(gid, "t", bv, 10), held.seq if held is not None else None)

    def actor_dies(self) -> None:
        actor = f"a{self.rng.randrange(4)}".encode()
        self.led.reclaim(holder=actor)
        self.rollouts = [r for r in self.rollouts if r[2] != actor]  # its episodes die with it

    def leases_expire(self) -> None:
        self.led.reclaim(older_than=self.now - self.lease)  # (the rollouts may still arrive, ticketless)

    # ----- the learner ---------------------------------------------------------------------------

    def take(self) -> None:
        if len(self.learner.inbox) >= self.prefetch:
            return
        batch, dropped = self.led.take_batch(LEARNER)
        for g in dropped:
            self.place[g.group_id] = "dropped_batch"
        if batch is None:
            return
        ids = [g.group_id for g in batch.groups]
        assert len(ids) == len(set(ids)) == self.led.groups_per_batch, self.where
        assert not any(too_stale(batch.train_version, g.behavior_version_min, self.eta) for g in batch.groups), \
            self.where
        assert not set(ids) & self.learner.held(), f"{self.where}: delivered twice"
        self.learner.inbox.append(batch)

    def train(self) -> None:
        lrn = self.learner
        if not lrn.inbox:
            return
        batch = lrn.inbox.pop(0)
        for g in batch.groups:  # the learner checks the bound again, at its own version
            self.learner_stale += too_stale(lrn.version, g.behavior_version_min, self.eta)
        lrn.trained += [g.group_id for g in batch.groups]
        lrn.version += 1
        self.led.set_version(lrn.version)

    def checkpoint(self) -> None:
        lrn = self.learner
        found, unknown = self.led.commit(lrn.trained)
        assert unknown == 0 and sorted(g.group_id for g in found) == sorted(lrn.trained), \
            f"{self.where}: a commit did not find what the learner trained"
        for gid in lrn.trained:
            assert self.place.get(gid) is None, f"{self.where}: {gid} committed twice"
            self.place[gid] = "committed"
        lrn.trained, lrn.checkpoint = [], lrn.version

    def learner_dies(self) -> None:
        """It resumes from its checkpoint: what it held comes back to the queue, its version rewinds."""
        self.led.requeue_delivered(LEARNER)
        self.learner = Learner(self.learner.checkpoint, self.learner.checkpoint)
        self.led.set_version(self.learner.version)

    def link_flaps(self) -> None:
        """The broker took the learner for gone (requeued its batches); it re-handshakes holding all of them."""
        self.led.requeue_delivered(LEARNER)
        batch, missing = self.led.hold(LEARNER, sorted(self.learner.held()), len(self.learner.inbox))
        assert missing == 0, f"{self.where}: held groups went elsewhere meanwhile"

    def broker_restarts(self) -> None:
        """A new broker from the spill log: every group not consumed back in the queue (their grant order and the
        running tickets lost), the last version it heard; the learner re-handshakes holding what it had."""
        old = self.led
        self.broker_starts += 1
        kept = [*old.queue, *(g for b in old.delivered.values() for g in b.groups
                               if g.group_id not in b.committed)]
        self.led = Ledger(groups_per_batch=old.groups_per_batch, eta=old.eta)
        self.led.counters.update(old.counters)  # (durable, as the broker's are)
        for g in kept:
            self.led.queue.push(g)
        self.led.set_version(old.version)
        self.led.requeue_delivered(LEARNER)  # (its Hello: nothing delivered yet)
        self.led.set_version(self.learner.version)
        if self.rng.random() < 0.5:  # its checkpoint's commit may come first: those groups leave from the queue
            self.checkpoint()
        batch, missing = self.led.hold(LEARNER, sorted(self.learner.held()), len(self.learner.inbox))
        assert missing == 0, f"{self.where}: a held group was not recovered"

    # ----- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        queued = [g.group_id for g in self.led.queue]
        delivered = set(self.led.delivered_group)
        assert len(queued) == len(set(queued)), f"{self.where}: queued twice"
        assert not set(queued) & delivered, f"{self.where}: queued and delivered"
        assert delivered == self.learner.held(), f"{self.where}: the ledger's delivered groups are not the learner's"
        elsewhere = set(self.place)
        assert not (set(queued) | delivered) & elsewhere, f"{self.where}: a group in two places"
        assert set(queued) | delivered | elsewhere == self.arrived, f"{self.where}: a group lost"
        assert self.led.capacity() >= 0 and self.led.accepted >= 0
        # Progress: with no rollout running, no batch at the learner and too few groups queued for one, a ticket
        # must be grantable, or the run waits forever (the learner for a batch, the actors for a ticket).
        if not self.rollouts and not self.learner.inbox and len(queued) < self.led.groups_per_batch:
            assert self.led.capacity() > 0, f"{self.where}: stalled at version {self.led.version}, " \
                f"next train version {self.led.next_train_version()}"

    def step(self) -> None:
        self.now += 1.0
        r = self.rng.random()
        events = [(0.30, self.grant), (0.55, self.arrive), (0.68, self.take), (0.82, self.train),
                  (0.90, self.checkpoint), (0.93, self.leases_expire), (0.95, self.actor_dies)]
        if self.failures:
            events += [(0.97, self.learner_dies), (0.985, self.link_flaps), (1.0, self.broker_restarts)]
        for edge, event in events:
            if r < edge:
                event()
                break
        self.check()

    def drain(self) -> None:
        """The actors stop; the learner trains all it can and checkpoints."""
        while self.rollouts:
            self.arrive()
        while True:
            self.take()
            if not self.learner.inbox:
                break
            while self.learner.inbox:
                self.train()
            self.checkpoint()
            self.check()
        self.checkpoint()
        self.check()
        left = [g.group_id for g in self.led.queue]
        assert len(left) < self.led.groups_per_batch and not self.led.delivered_group, self.where
        assert set(self.place) | set(left) == self.arrived


def run_seed(seed: int) -> Model:
    m = Model(seed)
    for _ in range(3000):
        m.step()
    m.drain()
    assert m.learner_stale == 0, f"{m.where}: the learner trained groups past η at its own version"
    return m


@pytest.mark.parametrize("seed", range(SEEDS))
def test_every_group_is_in_one_place_and_committed_once_whatever_happens(seed):
    run_seed(seed)


def test_the_random_runs_drop_requeue_and_commit():
    """The runs drop stale groups, requeue batches, hand held ones back and commit most groups: a model that stopped
    reaching those cases would pass the test above."""
    runs = [run_seed(seed) for seed in range(8)]
    places = [p for m in runs for p in m.place.values()]
    assert places.count("committed") > 0.5 * len(places)
    assert "dropped_batch" in places and "dropped_intake" in places
    counters = sum((m.led.counters for m in runs), start=type(runs[0].led.counters)())
    assert counters["groups_requeued"] > 0 and counters["groups_held_again"] > 0 and counters["version_rewound"] > 0
    assert sum(m.broker_starts for m in runs) > len(runs)
    assert counters["tickets_reclaimed"] > 0 and counters["groups_without_running_ticket"] > 0
