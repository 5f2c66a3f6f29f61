"""Chaos: a real `computerrl run` whose every role is killed (kill -9 and SIGTERM) on a seeded schedule;
the supervisor and --resume recover, and the audit finds no acked group lost or trained twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from launch.chaos import ROLES, Fault, network_schedule, run_chaos, schedule
from launch.chaos import summary as chaos_summary
from launch.netns import Fabric
from launch.netns import missing as netns_missing
from launch.local import free_port_overrides
from tests.conftest import REPO, children_of_run

pytestmark = pytest.mark.slow
pytest.importorskip("torch")


def test_every_role_killed_nothing_lost_nothing_trained_twice(tmp_path, monkeypatch):
    """The learner's kill -9 comes from the supervisor: the learner is stopped for good (SIGSTOP, never continued),
    never exits, and only its pulse stopping (local.hang_timeout_s) gets it killed and restarted."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    plan = schedule(seed=5, steps=10, kills=6, sigterm_share=0.5)
    assert [(k.step, k.role, k.kind) for k in plan][-1] == (7, "learner", "SIGKILL")
    plan[-1] = Fault(7, "learner", "stop")
    killed = {k.role for k in plan if k.signal == signal.SIGKILL or k.kind == "stop"}
    assert killed == set(ROLES), "kill -9 of every role"
    assert {k.role for k in plan if k.signal == signal.SIGTERM} == {"broker", "learner"}
    run_dir = tmp_path / "run"
    result = run_chaos("configs/local.yaml", run_dir, 10, plan,
                       # Exactly-once is the point, not the recipe: no anchor, two groups of 4 a step (the recipe's
                       # four of 8 cost this test four times the rollouts and proved nothing more).
                       [*free_port_overrides(), "local.eval_episodes=0", "learner.checkpoint_every=2",
                        "learner.anchor.suite=", "broker.group_size=4", "broker.groups_per_batch=2",
                        "local.restart_backoff_s=0.2", "local.max_restarts=10", "weights.join_window_s=0.5",
                        "local.hang_timeout_s=8"],
                       resume_steps=2, timeout_s=1200)
    audit = result.audit
    assert audit["ok"] and audit["lost"] == 0 and audit["trained_twice"] == 0, audit
    assert audit["trained_once"] >= 8, audit  # a third of 12 steps x 2 groups were trained
    assert audit["acked"] == audit["trained_once"] + audit["dropped_total"] + audit["queued"]
    assert audit["learner_starts"] >= 2 and audit["broker_starts"] >= 2, audit
    hit = [k for k in result.faults if k.pid]
    assert {k.role for k in hit} == set(ROLES), [(k.role, k.step) for k in result.faults]
    assert all(k.training_back_s is not None for k in hit), "training resumed after every kill"
    stopped = next(k for k in hit if k.kind == "stop")
    assert stopped.role_back_s is not None, "the learner stopped for good was replaced"
    said = (tmp_path / "run.supervisor.log").read_text()
    # Stopped by SIGINT once every fault had its turn: resumable, the learner checkpointed on its way out, and no role
    # of the run (nor of its final --resume) outlived it.
    assert "outcome: interrupted" in said and re.search(r"actor-\d exited with code -9; restart 1", said), said[-3000:]
    assert not children_of_run(run_dir), "no role outlived the run"
    assert re.search(r"learner-0 killed: hung: its main loop gave no sign of life for \d+ s \(local.hang_timeout_s\); "
                     r"process state T \(stopped: it cannot print its stacks\)", said), said[-3000:]
    # Every resumed learner that trained got its weights to the actors (a new sender, rounds from 1 again):
    # otherwise the actors would sample with a dead learner's weights until every group went stale. Both actors, but
    # for the final --resume's learner: it trains its 2 steps on groups already queued, and on a loaded machine one
    # actor was ready 2 s after the other and 11 ms after that learner's last round (seen 2026-12-04), with nothing
    # left to train for it.
    records = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()]
    resumed = {r["pid"] for r in records if r["event"] == "resumed"}
    trained = {r["pid"] for r in records if r["event"] == "train_step"} & resumed
    final = next(r["pid"] for r in reversed(records) if r["event"] == "train_step")
    reached: dict[int, int] = {}  # the most receivers each learner's rounds reached
    for r in records:
        if r["event"] == "weights_broadcast":
            reached[r["pid"]] = max(reached.get(r["pid"], 0), r["receivers"])
    assert trained and all(reached.get(pid, 0) == 2 for pid in trained - {final}), (trained, reached)
    assert reached.get(final, 0) >= 1, (final, reached)
    # The command a user runs on the same directory agrees, and exits 0.
    out = subprocess.run([sys.executable, "-m", "launch.cli", "audit", str(run_dir), "--json"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["trained_once"] == audit["trained_once"]



def test_partitioned_and_hung_roles_come_back_by_themselves_and_nothing_is_lost(tmp_path, monkeypatch):
    """Every role in a network namespace of its own: each role partitioned (link down) and hung (SIGSTOP) for
    three heartbeat timeouts, once each, one fault at a time. The learner's partition lands on a checkpoint step:
    its weight round and its commit go out into the cut."""
    why = netns_missing()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    span = 3 * 3 * 1.0  # three times net.liveness x net.heartbeat_s of configs/local.yaml
    plan = network_schedule(seed=6, steps=9, spans=(span,), checkpoint_every=2)  # steps 1..7 of the run's 10
    fabric = Fabric(f"t{os.getpid() % 10000}", 1, ["supervisor", "broker-0", "env_server-0", "learner-0",
                                                  "actor-0", "actor-1"]).create()
    try:
        result = run_chaos("configs/local.yaml", tmp_path / "run", 10, plan,
                           [*free_port_overrides(), "local.eval_episodes=0", "learner.checkpoint_every=2",
                            # the recipe's four groups a step: with two, the run's ten steps could end before
                            # its eighth fault had its turn (faults go one at a time)
                            "learner.anchor.suite=", "broker.group_size=4", "weights.join_window_s=0.5"],
                           resume_steps=1, timeout_s=1500, fabric=fabric)
    finally:
        fabric.destroy()
    summary = chaos_summary(result)
    print(json.dumps(summary["faults"]), json.dumps(summary["recovery_s_by_fault"]))
    audit = result.audit
    assert audit["ok"] and audit["lost"] == 0 and audit["trained_twice"] == 0, audit
    assert audit["acked"] == audit["trained_once"] + audit["dropped_total"] + audit["queued"]
    hit = [f for f in result.faults if f.pid]
    assert len(hit) == len(plan), [(f.role, f.kind, f.step) for f in result.faults]
    assert not [f for f in hit if f.restarted], "a partitioned or hung role came back by itself"
    assert all(f.training_back_s is not None for f in hit), "training resumed after every fault"
    cut = next(f for f in hit if f.role == "learner" and f.kind == "partition")
    assert cut.at_step % 2 == 0, "the learner was cut off as a checkpoint's commit and a weight round went out"
    assert result.resumes == 0, "the run never had to be restarted"
