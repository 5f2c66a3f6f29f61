"""The broker's ledger against a model of its actors and its learner: a Hypothesis state machine.

Each example draws B, η, the learner's prefetch and its checkpoint interval, then a run of stretches of normal
running and of faults. In a stretch, actors are granted tickets while there is capacity and their rollouts end in
any order (their groups arrive; stale ones are dropped at intake); the learner takes batches, trains them one
version at a time and commits what it trained at its checkpoints. The faults: an actor dies or leases run out
(tickets reclaimed; a rollout may still arrive); the learner dies (it resumes from its last checkpoint: everything
uncommitted goes back to the queue, the version rewinds), or loses its link and comes back holding what it had;
the broker restarts from its spill log.

After every event, by group id: each group that arrived is in exactly one place (queued, in a batch the learner
holds, committed, or dropped with a reason); the learner holds exactly the groups the ledger says it does; no
group is committed twice; every batch has B distinct groups, none past η at the version it is delivered for, nor
at the learner's own version when it trains it; and a run that can go on does: with no rollout running, no batch
at the learner and too few groups queued for one, a ticket can be granted. At the end the actors stop and the
learner drains the queue: every group is committed or dropped, but for fewer than B left queued.

Hypothesis shrinks a failure to a shortest run that shows it. ``COMPUTERRL_LEDGER_EXAMPLES=N`` runs N examples
instead of the quick tier's 200 (a soak)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from broker.ledger import DeliveredBatch, Ledger, QueuedGroup
from common.group_rules import too_stale

EXAMPLES = int(os.environ.get("COMPUTERRL_LEDGER_EXAMPLES", "0")) or 200
LEARNER = b"learner"
ACTORS = [f"a{i}".encode() for i in range(3)]


@dataclass
class Learner:
    """What the learner holds: batches not yet trained, groups trained since its last checkpoint."""

    version: int = 0
    checkpoint: int = 0
    inbox: list[DeliveredBatch] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)  # settled (trained or dropped) since the last checkpoint

    def held(self) -> set[str]:
        return {g.group_id for b in self.inbox for g in b.groups} | set(self.trained)


class LedgerRun(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.learner = Learner()
        self.rollouts: list[tuple[object, int, bytes]] = []  # (ticket, behaviour version, actor)
        self.now = 0.0
        self.arrived: set[str] = set()
        self.place: dict[str, str] = {}  # group id -> dropped_intake | dropped_batch | committed (else: ledger's)

    @initialize(groups_per_batch=st.sampled_from([1, 2, 4]), eta=st.integers(0, 3), prefetch=st.integers(1, 3),
                checkpoint_every=st.integers(1, 6))
    def start(self, groups_per_batch: int, eta: int, prefetch: int, checkpoint_every: int) -> None:
        self.led = Ledger(groups_per_batch=groups_per_batch, eta=eta)
        self.eta, self.prefetch, self.checkpoint_every = eta, prefetch, checkpoint_every

    # ----- running: tickets, rollouts, batches, steps -------------------------------------------

    @rule(seed=st.integers(0, 2**32 - 1), events=st.integers(1, 80))
    def traffic(self, seed: int, events: int) -> None:
        """A stretch of the run with nothing failing: ``events`` tickets, arrivals (in any order), batches and
        steps, drawn from ``seed``; the invariants hold after each. (One rule for many events: Hypothesis picks among
        its rules alike, and faults as often as rollouts end would leave nothing to train.)"""
        rng = random.Random(seed)
        for _ in range(events):
            r = rng.random()
            if r < 0.35:
                self.grant(rng)
            elif r < 0.7:
                self.arrive(rng.randrange(len(self.rollouts)) if self.rollouts else -1)
            elif r < 0.85:
                self.take()
            else:
                self.train()
            self.every_group_in_one_place()
            self.a_run_that_can_go_on_does()

    def grant(self, rng: random.Random) -> None:
        """A ticket while admission allows; the actor samples with the weights it has (the current version, or one
        behind)."""
        if self.led.capacity() <= 0:
            return
        self.now += 1
        actor = rng.choice(ACTORS)
        ticket = self.led.grant(f"r{self.now}", "t", actor, self.now)
        self.rollouts.append((ticket, max(0, self.led.version - rng.choice([0, 0, 1])), actor))

    def arrive(self, i: int) -> None:
        """Rollout ``i``'s group (none: -1); a stale one is dropped at intake."""
        if i < 0:
            return
        ticket, bv, _ = self.rollouts.pop(i)
        gid = f"g-{ticket.ticket_id}"
        self.arrived.add(gid)
        held = self.led.settle(ticket.ticket_id)
        if self.led.too_stale(bv):
            self.place[gid] = "dropped_intake"
        else:
            self.led.enqueue(QueuedGroup(gid, "t", bv, 10), held.seq if held is not None else None)

    def take(self) -> None:
        if len(self.learner.inbox) >= self.prefetch:
            return
        batch, dropped = self.led.take_batch(LEARNER)
        for g in dropped:
            self.place[g.group_id] = "dropped_batch"
        if batch is None:
            return
        ids = [g.group_id for g in batch.groups]
        assert len(ids) == len(set(ids)) == self.led.groups_per_batch
        assert not any(too_stale(batch.train_version, g.behavior_version_min, self.eta) for g in batch.groups)
        assert not set(ids) & self.learner.held(), "delivered twice"
        self.learner.inbox.append(batch)

    def train(self) -> None:
        lrn = self.learner
        if not lrn.inbox:
            return
        batch = lrn.inbox.pop(0)
        for g in batch.groups:  # the learner checks the bound again, at its own version
            assert not too_stale(lrn.version, g.behavior_version_min, self.eta), \
                f"trained at {lrn.version}, delivered for {batch.train_version}"
        lrn.trained += [g.group_id for g in batch.groups]
        lrn.version += 1
        self.led.set_version(lrn.version)
        if lrn.version % self.checkpoint_every == 0:  # (learner.checkpoint_every)
            self.checkpoint()

    def checkpoint(self) -> None:
        lrn = self.learner
        found, unknown = self.led.commit(lrn.trained)
        assert unknown == 0 and sorted(g.group_id for g in found) == sorted(lrn.trained), \
            "a commit did not find what the learner trained"
        for gid in lrn.trained:
            assert self.place.get(gid) is None, f"{gid} committed twice"
            self.place[gid] = "committed"
        lrn.trained, lrn.checkpoint = [], lrn.version

    # ----- faults --------------------------------------------------------------------------------

    @rule(actor=st.sampled_from(ACTORS))
    def actor_dies(self, actor: bytes) -> None:
        self.led.reclaim(holder=actor)
        self.rollouts = [r for r in self.rollouts if r[2] != actor]  # its episodes die with it

    @rule(age=st.integers(1, 20))
    def leases_expire(self, age: int) -> None:
        self.led.reclaim(older_than=self.now - age)  # (the rollouts may still arrive, ticketless)

    @rule()
    def learner_dies(self) -> None:
        """It resumes from its checkpoint: what it held comes back to the queue, its version rewinds."""
        self.led.requeue_delivered(LEARNER)
        self.learner = Learner(self.learner.checkpoint, self.learner.checkpoint)
        self.led.set_version(self.learner.version)

    @rule()
    def link_flaps(self) -> None:
        """The broker took the learner for gone (requeued its batches); it re-handshakes holding all of them."""
        self.led.requeue_delivered(LEARNER)
        _, missing = self.led.hold(LEARNER, sorted(self.learner.held()), len(self.learner.inbox))
        assert missing == 0, "held groups went elsewhere meanwhile"

    @rule(commit_first=st.booleans())
    def broker_restarts(self, commit_first: bool) -> None:
        """A new broker from the spill log: every group not consumed back in the queue (their grant order and the
        running tickets lost), the last version it heard; the learner re-handshakes holding what it had, its
        checkpoint's commit before or after that (a commit then finds its groups in the queue)."""
        old = self.led
        kept = [*old.queue, *(g for b in old.delivered.values() for g in b.groups if g.group_id not in b.committed)]
        self.led = Ledger(groups_per_batch=old.groups_per_batch, eta=old.eta)
        self.led.counters.update(old.counters)  # (durable, as the broker's are)
        for g in kept:
            self.led.queue.push(g)
        self.led.set_version(old.version)
        self.led.requeue_delivered(LEARNER)  # (its Hello: nothing delivered yet)
        self.led.set_version(self.learner.version)
        if commit_first:
            self.checkpoint()
        _, missing = self.led.hold(LEARNER, sorted(self.learner.held()), len(self.learner.inbox))
        assert missing == 0, "a held group was not recovered"

    # ----- invariants ----------------------------------------------------------------------------

    @invariant()
    def every_group_in_one_place(self) -> None:
        queued = [g.group_id for g in self.led.queue]
        delivered = set(self.led.delivered_group)
        assert len(queued) == len(set(queued)), "queued twice"
        assert not set(queued) & delivered, "queued and delivered"
        assert delivered == self.learner.held(), "the ledger's delivered groups are not the learner's"
        elsewhere = set(self.place)
        assert not (set(queued) | delivered) & elsewhere, "a group in two places"
        assert set(queued) | delivered | elsewhere == self.arrived, "a group lost"
        assert self.led.capacity() >= 0 and self.led.accepted >= 0

    @invariant()
    def a_run_that_can_go_on_does(self) -> None:
        """With no rollout running, no batch at the learner and too few groups queued for one, a ticket must be
        grantable, or the run waits for ever (the learner for a batch, the actors for a ticket)."""
        if not self.rollouts and not self.learner.inbox and len(self.led.queue) < self.led.groups_per_batch:
            assert self.led.capacity() > 0, \
                f"stalled at version {self.led.version}, next train version {self.led.next_train_version()}"

    def teardown(self) -> None:
        """The actors stop; the learner trains all it can and checkpoints: nothing but fewer than B groups stays."""
        if not hasattr(self, "led"):
            return
        while self.rollouts:
            self.arrive(len(self.rollouts) - 1)
        while True:
            if len(self.learner.inbox) < self.prefetch:
                self.take()
            if not self.learner.inbox:
                break
            while self.learner.inbox:
                self.train()
            self.checkpoint()
            self.every_group_in_one_place()
        self.checkpoint()
        self.every_group_in_one_place()
        left = [g.group_id for g in self.led.queue]
        assert len(left) < self.led.groups_per_batch and not self.led.delivered_group
        assert set(self.place) | set(left) == self.arrived


LedgerRun.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None)
test_every_group_is_in_one_place_committed_once_and_the_run_goes_on = LedgerRun.TestCase
