"""Broker bookkeeping without sockets: admission arithmetic, staleness, grant order, leases, requeue."""

from __future__ import annotations

import pytest

from broker.ledger import Ledger, QueuedGroup, admission_capacity
from common.group_rules import group_lag, no_reward_variance, too_stale


def q(i: int, v: int) -> QueuedGroup:
    return QueuedGroup(f"g{i}", f"task/{i}", v, 100)


@pytest.mark.parametrize("v,B,eta,accepted,running,cap", [
    (0, 8, 0, 0, 0, 8), (0, 8, 2, 0, 0, 24), (3, 4, 1, 12, 0, 8), (3, 4, 1, 12, 7, 1), (3, 4, 1, 14, 7, 0),
    (3, 4, 1, 20, 7, 0),
])
def test_admission_formula(v, B, eta, accepted, running, cap):
    assert admission_capacity(v, B, eta, accepted, running) == cap


def test_ledger_admits_exactly_eta_plus_one_batches_ahead():
    led = Ledger(groups_per_batch=4, eta=2)
    granted = []
    while led.capacity() > 0:
        granted.append(led.grant(f"r{len(granted)}", "t", b"a", 0.0))
    assert len(granted) == 12  # (η + v + 1)·B with v = 0
    for i, t in enumerate(granted[:4]):
        led.settle(t.ticket_id)
        led.enqueue(q(i, 0), t.seq)
    assert led.capacity() == 0
    batch, dropped = led.take_batch(b"L")
    assert batch is not None and batch.train_version == 0 and not dropped
    assert led.capacity() == 0  # handed out, not trained yet
    led.set_version(1)  # the learner applied it
    assert led.capacity() == 4


def test_stale_groups_dropped_at_batch_time_and_counted():
    led = Ledger(groups_per_batch=2, eta=1)
    led.set_version(5)
    for i, v in enumerate([3, 4, 5, 5]):
        led.enqueue(q(i, v))
    batch, dropped = led.take_batch(b"L")
    assert [g.group_id for g in dropped] == ["g0"]  # lag 2 > η = 1
    assert [g.behavior_version_min for g in batch.groups] == [4, 5]
    assert led.counters["dropped_stale"] == 1
    assert max(group_lag(batch.train_version, g.behavior_version_min) for g in batch.groups) <= led.eta
    assert led.too_stale(4) is True  # the next batch trains at v=6: lag 2


def test_queue_serves_oldest_version_then_grant_order():
    led = Ledger(groups_per_batch=3, eta=10)
    led.enqueue(q(1, 2), order=9)
    led.enqueue(q(2, 1), order=10)
    led.enqueue(q(3, 2), order=4)
    led.enqueue(q(4, 0), order=99)
    batch, _ = led.take_batch(b"L")
    assert [g.group_id for g in batch.groups] == ["g4", "g2", "g3"]


def test_short_queue_yields_no_batch_and_keeps_groups():
    led = Ledger(groups_per_batch=3, eta=1)
    led.enqueue(q(1, 0))
    led.enqueue(q(2, 0))
    batch, dropped = led.take_batch(b"L")
    assert batch is None and not dropped and len(led.queue) == 2


def test_batches_train_at_consecutive_versions_with_prefetch():
    led = Ledger(groups_per_batch=1, eta=3)
    for i in range(3):
        led.enqueue(q(i, 0))
    versions = [led.take_batch(b"L")[0].train_version for _ in range(3)]
    assert versions == [0, 1, 2]


def test_reclaim_by_holder_and_by_lease():
    led = Ledger(groups_per_batch=2, eta=0)
    a = led.grant("r1", "task/1", b"A", now=0.0)
    b = led.grant("r2", "task/2", b"B", now=5.0)
    assert led.capacity() == 0
    assert [t.task_id for t in led.reclaim(holder=b"A")] == ["task/1"]
    assert led.capacity() == 1
    assert [t.ticket_id for t in led.reclaim(older_than=10.0)] == [b.ticket_id]
    assert led.settle(a.ticket_id) is None and led.counters["groups_without_running_ticket"] == 1


def test_uncommitted_groups_requeued_after_learner_loss():
    led = Ledger(groups_per_batch=2, eta=5)
    for i in range(4):
        led.enqueue(q(i, 0), order=i)
    b1, _ = led.take_batch(b"L")
    b2, _ = led.take_batch(b"L")
    found, unknown = led.commit(["g0", "g1", "g2", "nope"])  # a checkpoint covered b1 and half of b2
    assert [g.group_id for g in found] == ["g0", "g1", "g2"] and unknown == 1
    assert b1.batch_id not in led.delivered and b2.batch_id in led.delivered
    back = led.requeue_delivered(holder=b"L")
    assert [g.group_id for g in back] == ["g3"]
    assert len(led.queue) == 1 and not led.delivered and not led.delivered_group
    led.enqueue(q(4, 0), order=4)
    again, _ = led.take_batch(b"L2")
    assert [g.group_id for g in again.groups] == ["g3", "g4"]


def test_held_groups_leave_the_queue_once_and_keep_their_order():
    """A learner back from a lost link holds what its handshake requeued: those groups are its again, counted once,
    and its untrained batch counts as handed out; requeued again (it died this time) they keep their serving order."""
    led = Ledger(groups_per_batch=2, eta=5)
    for i in range(6):
        led.enqueue(q(i, 0), order=i)
    b1, _ = led.take_batch(b"L")  # g0 g1: trained (version 1)
    b2, _ = led.take_batch(b"L")  # g2 g3: not trained yet
    led.set_version(1)
    assert led.accepted == (1 + 1) * 2 + 2
    led.requeue_delivered(holder=b"L")
    assert led.accepted == (1 + 0) * 2 + 6, "what the learner trained counts twice until it says it holds it"
    batch, missing = led.hold(b"L", ["g0", "g1", "g2", "g3", "gone"], untrained_batches=1)
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2", "g3"] and missing == 1
    assert led.accepted == (1 + 1) * 2 + 2 and sorted(g.group_id for g in led.queue) == ["g4", "g5"]
    assert led.next_train_version() == 2
    again, missing = led.hold(b"L", ["g0"], untrained_batches=0)
    assert again is None and missing == 1, "a group held already is not taken twice"
    led.requeue_delivered(holder=b"L")  # the learner died for good: everything goes out again, oldest order first
    nxt, _ = led.take_batch(b"L2")
    assert [g.group_id for g in nxt.groups] == ["g0", "g1"]
    assert led.hold(b"L2", ["g0", "g2"], untrained_batches=1)[0].groups[0].group_id == "g2"
    assert [g.group_id for g in led.take_batch(b"L2")[0].groups] == ["g3", "g4"]


def test_commit_takes_a_requeued_group_out_of_the_queue():
    """After a broker restart a group the learner trained is queued again; its Commit removes it."""
    led = Ledger(groups_per_batch=2, eta=5)
    for i in range(3):
        led.enqueue(q(i, 0), order=i)
    found, _ = led.commit(["g1"])
    assert [g.group_id for g in found] == ["g1"] and len(led.queue) == 2
    batch, _ = led.take_batch(b"L")
    assert [g.group_id for g in batch.groups] == ["g0", "g2"]
    assert led.queue.newest_first() == []


def test_the_group_rules_the_broker_and_the_learner_share():
    assert no_reward_variance([1.0, 1.0]) and no_reward_variance([0.0]) and not no_reward_variance([0.0, 1.0])
    assert no_reward_variance([0.5, 0.5 + 1e-13]) and not no_reward_variance([0.5, 0.5 + 1e-9])  # float noise
    assert too_stale(6, 4, 1) and not too_stale(6, 5, 1) and not too_stale(60, 0, None)


def test_lease_expiry_takes_exactly_the_tickets_granted_before_the_cutoff():
    led = Ledger(groups_per_batch=50, eta=0)
    tickets = [led.grant(f"r{i}", f"task/{i}", b"A" if i % 2 else b"B", now=float(i)) for i in range(20)]
    led.settle(tickets[3].ticket_id)  # settled ones are gone from the running set, wherever they were
    assert [t.ticket_id for t in led.reclaim(older_than=7.5)] == [t.ticket_id for t in tickets[:8] if t is not tickets[3]]
    assert [t.ticket_id for t in led.reclaim(holder=b"A")] == [t.ticket_id for t in tickets[9::2]]
    assert sorted(led.running) == sorted(t.ticket_id for t in tickets[8::2])
