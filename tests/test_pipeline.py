"""The whole async pipeline in one process (``launch/inprocess.py``): broker, env_server with sim desktops, actors
and the learner as threads over ZeroMQ inproc, training a few steps in seconds. The quick tier's check of
admission, staleness, ack/commit, weight versions and drops by reason; the process-level suites keep what only
processes show (kill -9, CURVE, Slurm, real desktops)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from broker.ledger import Ledger
from launch.audit import reconcile
from common.rundir import RunDir
from launch.config import load_run_config
from launch.inprocess import InProcessRun
from launch.local import free_port_overrides
from tests.conftest import REPO

pytest.importorskip("torch")

STEPS = 3
GROUPS_PER_BATCH = 2
DROP_REASONS = {"stale", "zero_variance", "incomplete"}


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def run_pipeline(tmp_path: Path, *overrides: str, steps: int = STEPS) -> tuple[RunDir, float]:
    """A tiny run of the embedded default, in process: two actors, batches of two groups of two, every group trained
    (none dropped for equal rewards), a commit at every step's checkpoint. Returns its run directory and seconds
    taken."""
    cfg = load_run_config(REPO / "configs" / "local.yaml", [
        *free_port_overrides(), f"learner.total_steps={steps}", "learner.checkpoint_every=1",
        f"broker.groups_per_batch={GROUPS_PER_BATCH}", "broker.group_size=2", "broker.eta=1", "learner.anchor.suite=",
        "learner.advantage.drop_zero_variance=false",
        "weights.join_window_s=0.5", "local.actors=2", "actor.max_groups=1", "net.heartbeat_s=0.2", *overrides])
    rd = RunDir.create(tmp_path / "run")
    t0 = time.monotonic()
    assert InProcessRun(cfg, rd, timeout_s=120).run(), "the learner did not finish its steps"
    return rd, time.monotonic() - t0


def check_pipeline(rd: RunDir, eta: int = 1, steps: int = STEPS) -> dict:
    """What a healthy run of ``steps`` steps leaves behind; raises AssertionError naming what broke. Returns the
    audit's counts."""
    learner = _records(rd.metrics / "learner.jsonl")
    assert [r["step"] for r in learner] == list(range(1, steps + 1)), "one version per step"
    assert (rd.checkpoints / "latest").read_text() == f"step-{steps:08d}"
    # Staleness: nothing trained further behind than eta, on the broker's histogram and in the learner's steps.
    assert max(r.get("max_lag", 0) for r in learner) <= eta
    broker = _records(rd.metrics / "broker.jsonl")[-1]
    assert all(n == 0 for k, n in broker["lag_hist"].items() if k == "16+" or int(k) > eta), broker["lag_hist"]
    # Weight rounds: every actor took weights and sampled with a newer policy than the start.
    for rank in (0, 1):
        actor = _records(rd.metrics / f"actor-{rank}.jsonl")[-1]
        assert actor["counters"]["weight_updates"] >= 1 and actor["version"] >= 1, actor
    # Exactly once, by group id: every acked group trained once, dropped with a reason, or still queued.
    audit = reconcile(rd.root)
    counts = audit.as_dict()
    assert audit.ok, audit.table()
    assert audit.acked == audit.trained_once + counts["dropped_total"] + audit.queued, audit.table()
    assert audit.trained_once == steps * GROUPS_PER_BATCH and set(audit.dropped) <= DROP_REASONS, audit.table()
    # Commit: what the learner settled left the broker, and nothing else did.
    settled = sum(1 for _ in _settled(rd))
    assert broker.get("groups_committed", 0) == settled, f"broker committed {broker.get('groups_committed', 0)} of " \
                                                          f"the {settled} groups the learner settled"
    return counts


def _settled(rd: RunDir):
    """Group ids the learner settled (trained or dropped) under a checkpoint, from its audit file."""
    for line in (rd.audit / "learner.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["e"] in ("trained", "dropped"):
            yield from ev.get("gs") or [ev["g"]]


def test_the_async_pipeline_trains_in_process_and_loses_nothing(tmp_path):
    """With cross-policy sampling on (one rollout of each group of two played by the run's initial policy): its
    rollouts train beside the current policy's, and the staleness bound keeps to the current policy's (by step 3 the
    initial policy is two versions behind, η is 1, and every group still trains)."""
    rd, seconds = run_pipeline(tmp_path, "actor.record.every=1", "broker.cross_policy_share=0.5",
                               "actor.cross_policy=initial")
    counts = check_pipeline(rd)
    assert seconds < 60, f"the in-process tier took {seconds:.0f} s"
    assert counts["lost"] == 0 and counts["trained_twice"] == 0
    check_recorded_episodes(rd)
    learner = _records(rd.metrics / "learner.jsonl")
    assert [r["cross_policy"] for r in learner] == [GROUPS_PER_BATCH] * STEPS, "one cross-policy rollout a group"
    for rank in (0, 1):
        counters = _records(rd.metrics / f"actor-{rank}.jsonl")[-1]["counters"]
        assert counters["cross_policy_episodes"] >= 1 and counters["episodes"] >= 1, counters
    from launch.episodes.collect import load

    crossed = [e for e in load(rd.root).episodes if e.get("cross_policy")]
    assert crossed and all(t["version"] == 0 for e in crossed for t in e["turns"]), "the initial policy's tokens"
    late = [e for e in crossed if e["fate"] == f"trained at version {STEPS - 1}"]
    assert late, "a rollout of version 0 trained at version 2 under eta = 1: outside the bound, by design"


def test_workflow_exploration_plays_beside_the_policy_and_its_groups_are_audited_like_any(tmp_path):
    """actor.workflows: the run records its demonstrations, each actor explores with the workflows they induce in
    one rollout of every group; the learner trains the explored successes by their own term, and the audit counts
    those groups like any other."""
    rd, _ = run_pipeline(tmp_path, "broker.group_size=3", "broker.tasks.suite=sim:train:infeasible",
                         "actor.workflows.suite=sim:train:infeasible", "actor.workflows.demos=2", steps=2)
    counts = check_pipeline(rd, steps=2)
    assert counts["lost"] == 0 and counts["trained_twice"] == 0
    assert rd.demos("workflows").exists()
    learner = _records(rd.metrics / "learner.jsonl")
    assert [r["explored"] for r in learner] == [GROUPS_PER_BATCH] * 2, "one explored rollout a group"
    assert sum(r["explored_successes"] for r in learner) >= 1 and any(r.get("explored_tokens") for r in learner)
    for rank in (0, 1):
        counters = _records(rd.metrics / f"actor-{rank}.jsonl")[-1]["counters"]
        # The last snapshot may fall mid-group: an explored rollout needs no model, so it finishes before the
        # policy's rollouts of the same group. The one-per-group shape is checked on what the learner trained.
        assert counters["explored_episodes"] >= 1 and counters["episodes"] > counters["explored_episodes"], counters


def check_recorded_episodes(rd: RunDir) -> None:
    """Every group an actor recorded is in the episode log, joined with what the learner did with it."""
    from launch.episodes.collect import load
    from launch.episodes.text import render_text

    eps = load(rd.root)
    groups = {e["group"] for e in eps.episodes}
    assert len(groups) >= STEPS * GROUPS_PER_BATCH and len(eps.episodes) == 2 * len(groups), "every episode of a group"
    trained = [e for e in eps.episodes if e["fate"].startswith("trained at version")]
    assert trained and all(len(e["advantages"]) == e["steps"] for e in trained), "each turn's advantage, from the learner"
    for e in eps.episodes:
        assert e["family"] and e["instruction"] and e["turns"] and e["split"] == "train"
        assert all(t["tokens"] > 0 and t["text"] and t["obs"] for t in e["turns"])
    text = render_text(trained[0], eps.images)
    assert trained[0]["instruction"] in text and "desktop: " in text and "advantage " in text


@pytest.mark.slow
def test_the_pipeline_check_fails_when_the_broker_forgets_a_commit(tmp_path, monkeypatch):
    """Break the commit protocol (a Commit that settles nothing: the broker keeps the groups as delivered) and the
    check must notice. Two steps are enough to show it (a commit after each). In the whole suite, not the quick
    tier: it checks the check, not the pipeline, and its run was an eighth of the quick tier's time."""
    monkeypatch.setattr(Ledger, "commit", lambda self, group_ids: ([], 0))
    rd, _ = run_pipeline(tmp_path, steps=2)
    with pytest.raises(AssertionError, match="broker committed 0 of the 4 groups the learner settled"):
        check_pipeline(rd, steps=2)


def test_a_learner_that_stops_is_counted_as_leaving_not_dead(tmp_path, monkeypatch, start_broker, quiet_log):
    """A stopping learner finishes its step and writes its checkpoint, which can take minutes for a large model:
    it says it is leaving and keeps heartbeating meanwhile, so the broker counts it left and requeues nothing while
    it stops. (It was declared dead 2.4 s after a SIGTERM, every Slurm preemption went that way.)"""
    from broker.client import ActorBrokerClient
    from broker.config import BrokerConfig
    from learner.config import LearnerConfig
    from learner.process import Learner
    from learner.trainer import Trainer
    from tests.test_learner import TINY
    from tests.test_learner import feed_until

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=1000, persist=False))
    dead_after = tb.net.dead_after_s
    learner = Learner(LearnerConfig(checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    thread = threading.Thread(target=learner.run, daemon=True)
    thread.start()
    actor = ActorBrokerClient(tb.net, None, quiet_log)
    try:
        actor.connect(30)
        feed_until(actor, lambda: actor.version >= 1)
        save = Trainer.save

        def slow_save(self, *a, **kw):  # the checkpoint of a model far larger than this one
            time.sleep(2 * dead_after)  # twice what a silent learner would have been given
            return save(self, *a, **kw)
        monkeypatch.setattr(Trainer, "save", slow_save)
        t0 = time.monotonic()
        learner.request_stop(checkpoint=True)
        while thread.is_alive() and time.monotonic() - t0 < 60:
            actor.poll(0.05)  # the feeding actor stays alive too: only the learner's silence is in question
        assert not thread.is_alive() and time.monotonic() - t0 > 2 * dead_after
    finally:
        actor.close()
    counters = tb.broker.counters
    deadline = time.monotonic() + 10  # the learner's goodbye is sent as its thread ends: the broker reads it after
    while counters.get("learners_left", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counters["learners_leaving"] == 1 and counters["learners_left"] == 1, dict(counters)
    assert counters.get("learners_dead", 0) == 0, dict(counters)
    assert (tb.run_dir.checkpoints / "latest").exists()


def test_an_entropulse_phase_imitates_stored_successes_and_returns_to_rl(tmp_path):
    """The learner loop through a whole Entropulse cycle: an RL step, then an SFT step on successes from the
    broker's store, after which the phase is RL again; every version once, the audit balanced (with η = 1, what
    waited through the SFT step is dropped as stale, never trained)."""
    rd, _ = run_pipeline(tmp_path, "learner.entropulse.mode=schedule", "learner.entropulse.rl_steps=1",
                         "learner.entropulse.sft_steps=1", "learner.entropulse.reset_reference=true", steps=2)
    learner = _records(rd.metrics / "learner.jsonl")
    assert [(r["step"], r["phase"]) for r in learner] == [(1, "rl"), (2, "sft")], learner
    assert "empty" not in learner[1], "the SFT step trained on stored successes"
    audit = reconcile(rd.root)
    counts = audit.as_dict()
    assert audit.ok and audit.acked == audit.trained_once + counts["dropped_total"] + audit.queued, audit.table()
    assert audit.trained_once >= GROUPS_PER_BATCH and set(audit.dropped) <= {"stale"}, audit.table()
    changes = [json.loads(x) for x in (rd.logs / "inprocess-0.jsonl").read_text().splitlines()
               if '"phase_change"' in x]
    assert [c["to"] for c in changes] == ["sft", "rl"], changes
