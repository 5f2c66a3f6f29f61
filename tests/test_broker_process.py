"""Real processes: ``kill -9`` of a persisting broker loses no acked group and delivers none twice."""

from __future__ import annotations

import json
import signal
import time

import pytest

from broker.client import ActorBrokerClient, LearnerBrokerClient
from common.exitcodes import EXIT_RESUMABLE
from tests.conftest import broker_process, kill9, make_group, make_net, pump

pytestmark = pytest.mark.slow

OVERRIDES = ("broker.groups_per_batch=2", "broker.group_size=2", "broker.eta=50", "broker.persist=true")


def _wait_ready(actor, proc, seconds=30.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return actor.connect(1.0)
        except TimeoutError:
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read().decode()[-2000:])
            if time.monotonic() > deadline:
                raise


def test_kill9_restart_no_acked_group_lost_none_delivered_twice(tmp_path, quiet_log):
    net = make_net(request_timeout_s=1.0)
    run_dir = tmp_path / "run"
    proc = broker_process(run_dir, net, *OVERRIDES)
    actor = ActorBrokerClient(net, None, quiet_log)
    _wait_ready(actor, proc)
    learner = LearnerBrokerClient(net, None, quiet_log)
    learner.connect(10)
    learner.set_control(0)

    submitted: dict[str, object] = {}

    def submit(n):
        for _ in range(n):
            actor.request_ticket()
        pump([actor], 10, until=lambda: len(actor.tickets) >= n)
        while actor.tickets:
            g = make_group(actor.tickets.popleft())
            submitted[g.group_id] = g
            actor.submit(g)

    submit(8)
    pump([actor], 10, until=lambda: actor.unacked == 0)
    delivered: list[str] = []
    learner.grant(2)
    for _ in range(2):
        delivered += [g.group_id for g in learner.next_batch(10).groups]
    learner.settle(delivered)  # trained, and a checkpoint covering them is durable: committed
    learner.checkpoint_durable(2)
    pump([learner], 5, until=lambda: learner.commits_confirmed == 1)

    submit(6)  # in flight when the broker dies: some acked, some not
    acked_before_kill = {a.group_id for a in actor.acks}
    kill9(proc)
    proc2 = broker_process(run_dir, net, *OVERRIDES)
    try:
        # The surviving actor notices the new epoch and re-sends every unacked group.
        pump([actor], 30, until=lambda: actor.unacked == 0)
        assert {a.group_id for a in actor.acks} >= acked_before_kill
        fresh = LearnerBrokerClient(net, None, quiet_log)  # no dedupe state: duplicates would show
        fresh.connect(10)
        fresh.grant(50)
        deadline = time.monotonic() + 20
        while len(delivered) < len(submitted) and time.monotonic() < deadline:
            b = fresh.next_batch(0.5)
            if b is not None:
                delivered += [g.group_id for g in b.groups]
        assert fresh.duplicates_dropped == 0
        assert len(delivered) == len(set(delivered)), "a group was delivered twice"
        assert set(delivered) == set(submitted), "an acked group was lost"
        pump([fresh], 1)
        fresh.close()
    finally:
        proc2.terminate()
        proc2.wait(10)
    actor.close()
    learner.close()
    logs = [json.loads(x) for x in (run_dir / "logs" / "broker-0.jsonl").read_text().splitlines()]
    assert any(x["event"] == "spill_recovered" for x in logs)
    assert any(x["event"] == "broker_stopped" for x in logs)  # SIGTERM is a clean stop


def test_kill9_mid_write_torn_tail_recovers(tmp_path, quiet_log):
    """Many kills in a row while groups stream in: every restart recovers and serves."""
    net = make_net(request_timeout_s=1.0)
    run_dir = tmp_path / "run"
    actor = None
    sent: set[str] = set()
    for round_ in range(3):
        proc = broker_process(run_dir, net, *OVERRIDES)
        if actor is None:
            actor = ActorBrokerClient(net, None, quiet_log)
            _wait_ready(actor, proc)
        for _ in range(4):
            g = make_group(version=0)
            sent.add(g.group_id)
            actor.submit(g)
        pump([actor], 0.3)
        kill9(proc)
    proc = broker_process(run_dir, net, *OVERRIDES)
    try:
        pump([actor], 30, until=lambda: actor.unacked == 0)
        learner = LearnerBrokerClient(net, None, quiet_log)
        learner.connect(10)
        learner.grant(20)
        got: list[str] = []
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            b = learner.next_batch(0.5)
            if b is not None:
                got += [g.group_id for g in b.groups]
        assert sorted(got) == sorted(sent)
        learner.close()
    finally:
        proc.terminate()
        proc.wait(10)
    actor.close()


def test_a_burst_of_stop_signals_stops_the_broker_cleanly(tmp_path):
    """Signals delivered while a handler (or the loop) is inside a lock must not deadlock: the handlers only set
    a flag (common/signals.py). Before, two SIGTERMs in a row could hang a role in Event.set forever."""
    net = make_net()
    proc = broker_process(tmp_path / "run", net)
    log = tmp_path / "run" / "logs" / "broker-0.jsonl"
    deadline = time.monotonic() + 60
    while not (log.exists() and '"broker_ready"' in log.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the broker did not come up"
        time.sleep(0.1)
    for _ in range(200):
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == EXIT_RESUMABLE, "stopped by a signal: resumable"
    assert any(json.loads(x)["event"] == "broker_stopped" for x in log.read_text().splitlines())
