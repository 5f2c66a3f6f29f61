"""Real processes: SIGTERM makes the learner checkpoint and exit; --resume continues the version sequence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from broker.client import ActorBrokerClient
from common.exitcodes import EXIT_RESUMABLE
from common.net.config import free_port
from tests.conftest import REPO, broker_process, make_net

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

from tests.plugins import POISON_LOGPROB  # noqa: E402
from tests.test_learner import feed_until  # noqa: E402  (a feeder with the learner's initial weights)


def _learner(run_dir, net, *extra, resume=False, env=None) -> subprocess.Popen:
    # Its weight-round port is a free one too: the default (25559) may be held by a local run on this machine.
    args = [sys.executable, "-m", "launch.cli", "learner", "--run-dir", str(run_dir),
            *(["--resume"] if resume else []),
            f"net.broker_front_port={net.broker_front_port}", f"net.broker_back_port={net.broker_back_port}",
            f"net.broker_control_port={net.broker_control_port}", f"net.heartbeat_s={net.heartbeat_s}",
            f"net.liveness={net.liveness}",
            "model.hidden_size=32", "model.intermediate_size=64", "learner.checkpoint_every=0",
            f"weights.port={free_port()}", "weights.join_window_s=0.05", *extra]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _two_ranks(run_dir, net, *extra, resume: bool) -> list[subprocess.Popen]:
    """Learner ranks 0 and 1 of one torch.distributed group (a fresh rendezvous port each time)."""
    port = free_port()
    return [_learner(run_dir, net, *extra, resume=resume,
                     env={"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(port),
                          # quiet: their stderr is a pipe read at the end, which a step's log lines could fill
                          "COMPUTERRL_QUIET": "1"}) for r in (0, 1)]


def _saved_version(run_dir) -> int:
    """The version of the run's latest checkpoint."""
    from learner import checkpoint as ckpt

    path = ckpt.latest(run_dir / "checkpoints")
    assert path is not None, "no checkpoint"
    return json.loads((path / ckpt.STATE_FILE).read_text())["version"]


def _end(actor, procs) -> None:
    """A test's clean-up: the feeding actor closed, whatever of ``procs`` still runs killed."""
    actor.close()
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(20)


def _audit(run_dir) -> dict:
    out = subprocess.run([sys.executable, "-m", "launch.cli", "audit", str(run_dir), "--json"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def test_sigterm_checkpoints_and_resume_continues_versions(tmp_path, quiet_log):
    net = make_net()
    run_dir = tmp_path / "run"
    broker = broker_process(run_dir, net, "broker.groups_per_batch=1", "broker.group_size=4", "broker.eta=1000",
                            "broker.persist=false")
    actor = ActorBrokerClient(net, None, quiet_log)
    learner = _learner(run_dir, net)
    try:
        actor.connect(60)
        feed_until(actor, lambda: actor.version >= 3)
        learner.send_signal(signal.SIGTERM)
        # Stopped before its total_steps: a clean, resumable exit (EX_TEMPFAIL), not "finished".
        assert learner.wait(60) == EXIT_RESUMABLE, learner.stderr.read().decode()[-2000:]
        saved = _saved_version(run_dir)
        assert saved >= 3
        steps = [json.loads(x)["step"] for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
        assert steps[-1] == saved, "the step in flight at the signal has its metrics record too"
        # A stop is not a death: the learner said it was leaving and kept its link alive through its last step
        # and checkpoint, however long they took; the broker counted it left and declared nothing dead.
        # The broker reads the learner's Goodbye on its own loop, after the learner may have exited: wait for its log.
        def broker_events() -> list[str]:
            lines = (run_dir / "logs" / "broker-0.jsonl").read_text().splitlines()
            return [json.loads(x)["event"] for x in lines if x.strip()]
        deadline = time.monotonic() + 10
        while "learner_left" not in (names := broker_events()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "learner_leaving" in names and "learner_left" in names and "learner_dead" not in names, names
        assert names.index("learner_leaving") < names.index("learner_left")
        learner = _learner(run_dir, net, f"learner.total_steps={saved + 2}", resume=True)
        feed_until(actor, lambda: learner.poll() is not None)
        assert learner.returncode == 0, learner.stderr.read().decode()[-2000:]
        final = _saved_version(run_dir)
        assert final == saved + 2, "the resumed learner continued the version sequence"
        log = (run_dir / "logs" / "learner-0.jsonl").read_text()
        assert '"resumed"' in log
    finally:
        _end(actor, [learner, broker])


def test_a_group_whose_step_kills_a_learner_rank_is_set_aside_after_two_crashes(tmp_path, quiet_log):
    """Two learner ranks; one group makes the rank that trains it die by SIGKILL inside the step (a kernel's segfault,
    the OOM killer), and the other rank's collectives fail with it. The first crash counts against the whole batch;
    restarted (as the supervisor would), the learner probes each group counted before alone, and the planted one
    kills it again, counted alone. At the third start it is set aside, kept on disk, and settled as dropped
    (``step_crashed``), while its batch partner passes its probe and is trained; the run finishes, and the audit finds
    nothing acked lost."""
    net = make_net()
    run_dir = tmp_path / "run"
    broker = broker_process(run_dir, net, "broker.groups_per_batch=2", "broker.group_size=4", "broker.eta=1000")
    actor = ActorBrokerClient(net, None, quiet_log)
    steps = 4

    def ranks(resume: bool) -> list[subprocess.Popen]:
        return _two_ranks(run_dir, net, "learner.loss.name=tests.plugins:killing_grpo_loss",
                          "learner.checkpoint_every=1", f"learner.total_steps={steps}", resume=resume)

    poison: list[str] = []

    def plant(n, g) -> None:
        if n == 3 and not poison:  # once, after a step or so has trained: the crash is not the first step's
            g.trajectories[0].logprobs[0] = POISON_LOGPROB
            poison.append(g.group_id)

    learners = ranks(False)
    try:
        actor.connect(60)
        for crash in (1, 2):
            feed_until(actor, lambda: all(p.poll() is not None for p in learners), alter=plant)
            codes = sorted(p.returncode for p in learners)
            assert codes[0] == -signal.SIGKILL and codes[1] != 0, (crash, codes)
            learners = ranks(True)
        feed_until(actor, lambda: all(p.poll() is not None for p in learners), alter=plant)
        assert [p.returncode for p in learners] == [0, 0], learners[0].stderr.read().decode()[-3000:]
    finally:
        _end(actor, [*learners, broker])
    log = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()]
    crashed = [r for r in log if r["event"] == "step_crashed"]
    assert len(crashed) == 2 and all(poison[0] in r["crashes"] for r in crashed), crashed
    assert len(crashed[0]["crashes"]) == 2, "the batch's step: both its groups counted"
    assert crashed[1]["crashes"] == {poison[0]: 2}, "the planted group's probe: counted alone"
    aside = [r for r in log if r["event"] == "groups_set_aside"]
    assert len(aside) == 1 and aside[0]["groups"] == poison, aside
    kept = run_dir / "quarantine" / f"{poison[0]}.msgpack"
    from common.demofile import read_group
    assert read_group(kept).trajectories[0].logprobs[0] == POISON_LOGPROB
    audit = _audit(run_dir)
    assert audit["ok"] and audit["lost"] == 0 and audit["trained_twice"] == 0, audit
    assert audit["dropped"].get("step_crashed", 0) == 1, audit
    partner = next(g for g in crashed[0]["crashes"] if g != poison[0])
    trained = [json.loads(x) for x in (run_dir / "audit" / "learner.jsonl").read_text().splitlines()]
    assert any(partner in e.get("gs", []) for e in trained if e["e"] == "trained"), "the partner was trained"


def test_a_learner_rank_that_hangs_fails_the_others_within_the_collective_timeout_and_a_restart_goes_on(tmp_path,
                                                                                                         quiet_log):
    """Two learner ranks; rank 1 is stopped (SIGSTOP: a process swapped out, a frozen node), not killed, while both
    wait for the next batch. Rank 0's next job went out on the job channel, whose collectives waited a week for a rank
    that is connected but never joins: the run stalled. Now rank 0 fails within ``learner.dist_timeout_s``, as a
    training collective does, and exits with the error (the supervisor then restarts both ranks); restarted from the
    checkpoint, the ranks finish the run and the audit finds nothing acked lost or trained twice."""
    net = make_net()
    run_dir = tmp_path / "run"
    broker = broker_process(run_dir, net, "broker.groups_per_batch=1", "broker.group_size=4", "broker.eta=1000")
    actor = ActorBrokerClient(net, None, quiet_log)
    timeout_s = 5

    def ranks(resume: bool, steps: int) -> list[subprocess.Popen]:
        return _two_ranks(run_dir, net, "learner.checkpoint_every=1", f"learner.total_steps={steps}",
                          f"learner.dist_timeout_s={timeout_s}", resume=resume)

    learners = ranks(False, 100)
    try:
        actor.connect(60)
        sent: list[int] = []
        feed_until(actor, lambda: len(sent) >= 2, alter=lambda n, g: sent.append(n))  # two groups, two steps
        deadline = time.monotonic() + 120
        while actor.version < 2:  # trained: both ranks now wait for the next batch, rank 1 inside the job channel
            assert time.monotonic() < deadline, f"version {actor.version} of 2"
            actor.poll(0.1)
        time.sleep(1)
        os.kill(learners[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        feed_until(actor, lambda: learners[0].poll() is not None, seconds=60)  # the next batch: a job for both
        waited = time.monotonic() - t0
        err = learners[0].stderr.read().decode()
        assert learners[0].returncode not in (0, EXIT_RESUMABLE), err[-3000:]
        assert "learner.dist_timeout_s" in err, err[-3000:]
        assert waited < timeout_s + 30, f"rank 0 took {waited:.0f} s to give up"
        learners[1].kill()
        assert learners[1].wait(20) == -signal.SIGKILL
        saved = _saved_version(run_dir)
        learners = ranks(True, saved + 2)
        feed_until(actor, lambda: all(p.poll() is not None for p in learners))
        assert [p.returncode for p in learners] == [0, 0], learners[0].stderr.read().decode()[-3000:]
    finally:
        _end(actor, [*learners, broker])
    audit = _audit(run_dir)
    assert audit["ok"] and audit["lost"] == 0 and audit["trained_twice"] == 0, audit


def test_a_step_that_never_returns_ends_the_learner_as_a_crash_and_its_group_is_set_aside(tmp_path, quiet_log):
    """A step that hangs (here the loss, on one planted group) left a learner that heartbeats on and trains nothing:
    the broker saw it alive, the supervisor saw no exit, the run stood still. Past ``learner.job_timeout_s`` the
    learner now logs its threads' stacks and exits as a crash; restarted, it counts the step in flight against its
    group, sets the group aside (``max_step_crashes`` 1 here) and finishes, and the audit finds nothing lost."""
    net = make_net()
    run_dir = tmp_path / "run"
    broker = broker_process(run_dir, net, "broker.groups_per_batch=1", "broker.group_size=4", "broker.eta=1000")
    actor = ActorBrokerClient(net, None, quiet_log)
    steps = 3

    def learner(resume: bool) -> subprocess.Popen:
        return _learner(run_dir, net, "learner.loss.name=tests.plugins:hanging_grpo_loss", "learner.job_timeout_s=10",
                        "learner.max_step_crashes=1", "learner.checkpoint_every=1", f"learner.total_steps={steps}",
                        resume=resume, env={"COMPUTERRL_QUIET": "1"})

    poison: list[str] = []

    def plant(n, g) -> None:
        if n == 2 and not poison:
            g.trajectories[0].logprobs[0] = POISON_LOGPROB
            poison.append(g.group_id)

    proc = learner(False)
    try:
        actor.connect(60)
        feed_until(actor, lambda: proc.poll() is not None, seconds=120, alter=plant)
        err = proc.stderr.read().decode()
        assert proc.returncode == 1, err[-3000:]
        assert "learner.job_timeout_s=10 s" in err and "in hanging_grpo_loss" in err, err[-3000:]
        proc = learner(True)
        feed_until(actor, lambda: proc.poll() is not None, seconds=120, alter=plant)
        assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
    finally:
        _end(actor, [proc, broker])
    log = [json.loads(x) for x in (run_dir / "logs" / "learner-0.jsonl").read_text().splitlines()]
    hung = [r for r in log if r["event"] == "training_job_hung"]
    assert len(hung) == 1 and hung[0]["seconds"] >= 10, hung
    crashed = [r for r in log if r["event"] == "step_crashed"]
    assert len(crashed) == 1 and crashed[0]["crashes"] == {poison[0]: 1}, crashed
    aside = [r for r in log if r["event"] == "groups_set_aside"]
    assert len(aside) == 1 and aside[0]["groups"] == poison, aside
    audit = _audit(run_dir)
    assert audit["ok"] and audit["lost"] == 0 and audit["trained_twice"] == 0, audit
    assert audit["dropped"].get("step_crashed", 0) == 1, audit
