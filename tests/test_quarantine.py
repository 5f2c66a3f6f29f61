"""Groups whose steps killed the learner: counted across its restarts, set aside once counted enough, the rest of
their batch trained (``learner/quarantine.py``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from common import protocol as P  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.process import Learner  # noqa: E402
from common.demofile import read_group, write_group  # noqa: E402
from learner.quarantine import CRASHES, IN_FLIGHT, CrashedSteps, success_key  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from tests.test_learner import TINY, groups_from  # noqa: E402


def test_a_step_that_never_ended_counts_against_its_groups_and_twice_sets_them_aside(tmp_path, quiet_log):
    groups = {g.group_id: g for g in groups_from(Trainer(LearnerConfig(), TINY), n_groups=2)}
    a, b = list(groups)
    first = CrashedSteps(tmp_path, 2, quiet_log)
    assert first.found == [] and first.crashes == {}
    first.begin("batch-1", 3, [a, b])  # ... and the process dies inside the step

    second = CrashedSteps(tmp_path, 2, quiet_log)
    assert second.found == [a, b] and second.crashes == {a: 1, b: 1}
    assert not (tmp_path / IN_FLIGHT).exists(), "counted once: a third start must not count that step again"
    assert second.counted_out(groups) == []
    second.begin("batch-2", 3, [a])  # dies again, with a alone

    third = CrashedSteps(tmp_path, 2, quiet_log)
    assert third.found == [a] and third.crashes == {a: 2, b: 1}
    assert third.counted_out(groups) == [a]
    third.keep(a, groups[a])
    kept = read_group(tmp_path / f"{a}.msgpack")
    assert kept.group_id == a and len(kept.trajectories) == len(groups[a].trajectories)
    assert (kept.trajectories[0].logprobs == groups[a].trajectories[0].logprobs).all()
    third.begin("batch-3", 4, [b])
    third.end()  # a step that ended in this process is no crash
    third.settled([a, b])
    assert CrashedSteps(tmp_path, 2, quiet_log).crashes == {a: 2, b: 1}, "kept until a checkpoint commits them"
    third.committed()
    assert json.loads((tmp_path / CRASHES).read_text()) == {}

    fourth = CrashedSteps(tmp_path, 2, quiet_log)
    assert fourth.found == [] and fourth.crashes == {}


def test_off_writes_nothing_and_a_refusing_file_system_costs_the_count_not_the_learner(tmp_path, quiet_log):
    groups = groups_from(Trainer(LearnerConfig(), TINY), n_groups=1)
    off = CrashedSteps(tmp_path / "off", 0, quiet_log)
    off.begin("b", 0, [groups[0].group_id])
    assert not (tmp_path / "off").exists()
    off.crashes[groups[0].group_id] = 5
    assert off.counted_out([groups[0].group_id]) == []

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    broken = CrashedSteps(blocker / "quarantine", 1, quiet_log)  # under a file: every write fails
    broken.begin("b", 0, [groups[0].group_id])
    broken.end()
    broken.settled([groups[0].group_id])
    broken.crashes[groups[0].group_id] = 1
    assert broken.counted_out([groups[0].group_id]) == [groups[0].group_id]
    broken.keep(groups[0].group_id, groups[0])  # set aside even where it cannot be kept: logged, not raised

    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / CRASHES).write_text("{not json")
    (garbled / IN_FLIGHT).write_text("[1, 2]")
    fresh = CrashedSteps(garbled, 2, quiet_log)
    assert fresh.crashes == {} and fresh.found == []
    (garbled / CRASHES).write_text(json.dumps({"a": "two", "b": 1, "c": None}))
    (garbled / IN_FLIGHT).write_text(json.dumps({"groups": "a"}))
    odd = CrashedSteps(garbled, 2, quiet_log)
    assert odd.crashes == {"b": 1} and odd.found == [] and odd.counted_out(["a", "b", "c"]) == []


def test_the_learner_sets_aside_what_crashed_it_trains_the_rest_and_settles_both(start_broker, quiet_log):
    """A predecessor died in a step over groups a and b, twice over a: at its delivery, a is settled as dropped
    (``step_crashed``, audited, counted) and kept on disk, b is trained; a step that dies leaves its groups counted."""
    tb = start_broker()
    trainer = Trainer(LearnerConfig(), TINY)
    a, b = groups_from(trainer, n_groups=2)
    tb.run_dir.quarantine.mkdir()
    (tb.run_dir.quarantine / CRASHES).write_text(json.dumps({a.group_id: 1}))
    (tb.run_dir.quarantine / IN_FLIGHT).write_text(json.dumps({"batch": "x", "groups": [a.group_id, b.group_id]}))
    learner = Learner(LearnerConfig(checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    assert learner.trainer.counters["steps_crashed"] == 1
    m = learner._rl_step(P.Batch(batch_id="y", train_version=0, groups=[a, b]))
    assert m["outcomes"] == {a.group_id: "step_crashed", b.group_id: "trained"} and "empty" not in m
    assert learner.trainer.counters["groups_dropped_step_crashed"] == 1
    assert read_group(tb.run_dir.quarantine / f"{a.group_id}.msgpack").group_id == a.group_id
    assert not (tb.run_dir.quarantine / IN_FLIGHT).exists()
    learner._settle(m["outcomes"])
    assert json.loads((tb.run_dir.quarantine / CRASHES).read_text()) == {a.group_id: 2, b.group_id: 1}
    assert learner.checkpoint()
    assert json.loads((tb.run_dir.quarantine / CRASHES).read_text()) == {}
    learner.audit.close()
    audit = [json.loads(x) for x in (tb.run_dir.audit / "learner.jsonl").read_text().splitlines()]
    assert {"e": "dropped", "g": a.group_id, "r": "step_crashed", "v": 1}.items() <= next(
        e for e in audit if e["e"] == "dropped").items()
    assert [e["gs"] for e in audit if e["e"] == "trained"] == [[b.group_id]]

    # A batch of set-aside groups alone makes an empty step; one that dies (what no ``except Exception`` catches
    # stands in for a SIGKILL here) leaves its groups counted for the next start.
    learner.crashes.crashes[b.group_id] = 2
    m = learner._rl_step(P.Batch(batch_id="z", train_version=1, groups=[b]))
    assert "empty" in m and m["outcomes"] == {b.group_id: "step_crashed"}

    def dies(groups, eta=None):
        raise KeyboardInterrupt

    learner.trainer.train_step = dies
    c = groups_from(trainer, n_groups=1, seed=7)[0]
    with pytest.raises(KeyboardInterrupt):
        learner._rl_step(P.Batch(batch_id="w", train_version=1, groups=[c]))
    assert CrashedSteps(tb.run_dir.quarantine, 2, quiet_log).crashes[c.group_id] == 1


def test_an_sft_step_leaves_out_stored_successes_that_killed_the_learner_and_counts_those_it_dies_in(
        start_broker, quiet_log):
    tb = start_broker()
    trainer = Trainer(LearnerConfig(), TINY)
    trajs = [t for g in groups_from(trainer, n_groups=1) for t in g.trajectories if t.success]
    samples = [P.SuccessSample(task_id=f"sim:train/{i}", trajectory=t) for i, t in enumerate(trajs)]
    bad, good = success_key(samples[0]), success_key(samples[1])
    tb.run_dir.quarantine.mkdir()
    (tb.run_dir.quarantine / CRASHES).write_text(json.dumps({bad: 2, good: 1}))
    learner = Learner(LearnerConfig(checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    trained: list[list[str]] = []
    real = learner.trainer.sft_step

    def sft_step(trajectories, lr):
        trained.append([t.traj_id for t in trajectories])
        return real(trajectories, lr)

    learner.trainer.sft_step = sft_step
    m = learner._sft_step(1e-4, P.SuccessBatch(samples=samples))
    assert "empty" not in m and trained == [[samples[1].trajectory.traj_id]]
    assert learner.trainer.counters["successes_set_aside_step_crashed"] == 1
    kept = read_group(tb.run_dir.quarantine / f"{bad}.msgpack")
    assert kept.task_id == "sim:train/0" and kept.trajectories[0].traj_id == samples[0].trajectory.traj_id
    learner.crashes.committed()
    assert learner.crashes.crashes == {bad: 2}, "a success trained is settled"

    def dies(trajectories, lr):
        raise KeyboardInterrupt

    learner.trainer.sft_step = dies
    with pytest.raises(KeyboardInterrupt):
        learner._sft_step(1e-4, P.SuccessBatch(samples=samples[1:]))
    assert CrashedSteps(tb.run_dir.quarantine, 2, quiet_log).crashes == {bad: 2, good: 1}
    assert "empty" in Learner(LearnerConfig(checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)._sft_step(
        1e-4, P.SuccessBatch(samples=samples[:1]))


def _run_with_a_group_set_aside(tmp_path, poisoned: bool = False):
    """A run directory (tiny model, the default config otherwise) with one group set aside and no checkpoint."""
    from common import config as configlib
    from common.rundir import RunDir
    from launch.config import load_run_config
    from tests.plugins import POISON_LOGPROB

    rd = RunDir.create(tmp_path / "run")
    configlib.dump(load_run_config(None, TINY_OVERRIDES), rd.config)
    group = groups_from(Trainer(LearnerConfig(), TINY), n_groups=1)[0]
    if poisoned:
        group.trajectories[0].logprobs[0] = POISON_LOGPROB
    rd.quarantine.mkdir()
    write_group(rd.quarantine / f"{group.group_id}.msgpack", group)
    return rd, group


TINY_OVERRIDES = ("model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=4",
                  "model.num_kv_heads=2")


def test_replay_step_trains_a_set_aside_group_alone_and_names_those_there_are(tmp_path):
    from click.testing import CliRunner

    from launch.cli import main

    rd, group = _run_with_a_group_set_aside(tmp_path)
    before = sorted(str(p.relative_to(rd.root)) for p in rd.root.rglob("*"))
    out = CliRunner().invoke(main, ["replay-step", str(rd.root), group.group_id, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["outcomes"] == {group.group_id: "trained"} and result["checkpoint"] is None
    assert result["from_version"] == 0 and result["loss"] == result["loss"]  # a number, not NaN
    assert sorted(str(p.relative_to(rd.root)) for p in rd.root.rglob("*")) == before, "nothing written"
    out = CliRunner().invoke(main, ["replay-step", str(rd.root), "nope"])
    assert out.exit_code == 1 and f"those set aside are {group.group_id}" in out.output

    # a stored success set aside from SFT steps is replayed as the SFT step it was in
    from learner.quarantine import success_group

    sample = P.SuccessSample(task_id="sim:train/3", trajectory=next(t for t in group.trajectories if t.success))
    success = success_group(sample)
    write_group(rd.quarantine / f"{success.group_id}.msgpack", success)
    out = CliRunner().invoke(main, ["replay-step", str(rd.root), success.group_id, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["outcomes"] == {success.group_id: "trained"} and result["version"] == 1


def test_replay_step_from_a_damaged_checkpoint_says_what_to_do_and_reads_nothing(tmp_path):
    from click.testing import CliRunner

    from launch.cli import main
    from tests.conftest import whole_checkpoint

    rd, group = _run_with_a_group_set_aside(tmp_path)
    whole_checkpoint(rd.checkpoints, 1)
    damaged = whole_checkpoint(rd.checkpoints, 2)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])  # a copy cut short
    for args in ([], ["--checkpoint", str(damaged)]):
        out = CliRunner().invoke(main, ["replay-step", str(rd.root), group.group_id, *args])
        assert out.exit_code == 1, out.output
        assert f"checkpoint {damaged} is damaged" in out.output and "The newest whole one is step-00000001" in out.output
        assert "Traceback" not in out.output


@pytest.mark.slow
def test_replay_step_crashes_as_the_learner_did_and_all_tells_the_culprit_from_its_partner(tmp_path):
    """The planted group that killed the learner's rank kills its replay the same way; ``all`` replays each group set
    aside in a process of its own and says which one kills it and which one trains."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    rd, poisoned = _run_with_a_group_set_aside(tmp_path, poisoned=True)
    partner = groups_from(Trainer(LearnerConfig(), TINY), n_groups=1, seed=5)[0]
    write_group(rd.quarantine / f"{partner.group_id}.msgpack", partner)
    # each group's replay-step in a process of its own, its exit status read
    out = subprocess.run([sys.executable, "-m", "launch.cli", "replay-step", str(rd.root), "all", "--json",
                          "learner.loss.name=tests.plugins:killing_grpo_loss"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    said = {r["group"]: r["outcome"] for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert said == {poisoned.group_id: "killed by SIGKILL", partner.group_id: "trained"}, said


def test_a_group_counted_before_is_probed_alone_first_and_a_crash_there_counts_against_it_alone(start_broker,
                                                                                                quiet_log):
    """A probe runs the step's passes over one group without its update; a batch holding a group counted in an earlier
    crash probes that group alone first, under a record naming it alone."""
    import torch

    tb = start_broker()
    a, b = groups_from(Trainer(LearnerConfig(), TINY), n_groups=2)
    tb.run_dir.quarantine.mkdir()
    (tb.run_dir.quarantine / CRASHES).write_text(json.dumps({a.group_id: 1}))
    learner = Learner(LearnerConfig(checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    t = learner.trainer
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    counters = dict(t.counters)
    t.probe_step([a, b])
    assert t.version == 0 and t.counters == counters
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters()), "no update"
    assert all(p.grad is None for p in t.model.parameters()), "no gradient left for the next step"

    probed, real = [], t.probe_step
    t.probe_step = lambda groups, eta=None: (probed.append([g.group_id for g in groups]), real(groups, eta))[1]
    m = learner._rl_step(P.Batch(batch_id="y", train_version=0, groups=[a, b]))
    assert probed == [[a.group_id]] and m["outcomes"] == {a.group_id: "trained", b.group_id: "trained"}
    assert t.version == 1 and t.counters["groups_probed"] == 1

    def dies(groups, eta=None):
        raise KeyboardInterrupt

    t.probe_step = dies
    with pytest.raises(KeyboardInterrupt):
        learner._rl_step(P.Batch(batch_id="z", train_version=1, groups=[a, b]))
    assert CrashedSteps(tb.run_dir.quarantine, 2, quiet_log).crashes == {a.group_id: 2}, "b is not blamed"

    def raises(groups, eta=None):  # an error, not a crash: the batch's step meets it, or not, as it would have
        raise ValueError("a bad group")

    t.probe_step = raises
    m = learner._rl_step(P.Batch(batch_id="w", train_version=1, groups=[a, b]))
    assert m["outcomes"] == {a.group_id: "trained", b.group_id: "trained"} and t.version == 2
    assert not (tb.run_dir.quarantine / IN_FLIGHT).exists()


def test_the_audits_table_says_where_the_groups_set_aside_are():
    import collections

    from common.audit import Reconciliation

    assert "quarantine/" not in Reconciliation(dropped=collections.Counter(stale=3)).table()
    said = Reconciliation(acked=4, dropped=collections.Counter(step_crashed=1, stale=3)).table()
    assert "dropped: step_crashed" in said and "computerrl replay-step RUN GROUP_ID" in said
