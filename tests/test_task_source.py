"""Which task a ticket hands out: the seeded walk over a suite, and adaptive curation by family."""

from __future__ import annotations

import collections
import json

import pytest

from broker.config import BrokerConfig, TaskSourceConfig
from broker.task_sampler import CuratedSampler, TaskSampler, suite_families
from common.config import ConfigError, build
from env_server.sim import families as sim_tasks
from tests.conftest import make_group, pump
from tests.test_broker import clients, take_tickets


def test_task_sampler_deterministic_and_reissues_first():
    a = TaskSampler("sim:train", 10, 5, True, seed=3)
    b = TaskSampler("sim:train", 10, 5, True, seed=3)
    seq = [a.next() for _ in range(10)]
    assert seq == [b.next() for _ in range(10)]
    assert sorted(seq[:5]) == [f"sim:train/{s}" for s in range(10, 15)]
    a.reissue.append("sim:train/99")
    assert a.next() == "sim:train/99"


def test_suite_families_read_names_and_weights_or_ask_the_kind():
    assert suite_families("sim:train:sheet_sort*3,files_move,sheet_sort") == (
        "sim", "train", [("sheet_sort", 4), ("files_move", 1)])
    kind, split, fams = suite_families("sim:train")
    assert (kind, split) == ("sim", "train") and [f for f, _ in fams] == list(sim_tasks.FAMILY_NAMES)
    with pytest.raises(ValueError, match="name them in broker.tasks.suite"):
        suite_families("someplugin:train")
    with pytest.raises(ValueError, match="must be an integer in 1..100"):
        suite_families("sim:train:sheet_sort*0")


def _feed(s: CuratedSampler, family: str, rate: float, groups: int, g: int = 8) -> None:
    wins = round(rate * g)
    for _ in range(groups):
        s.observe(f"sim:train:{family}/0", [True] * wins + [False] * (g - wins))


def test_curation_spends_tickets_on_families_with_mixed_success():
    s = CuratedSampler("sim:train:sheet_sort,files_move,editor_append", 0, 1000, True, seed=1, floor=0.1,
                       halflife_groups=4.0)
    assert {s.weight(f) for f in s.prior} == {1.0}, "unseen families start as the most informative"
    _feed(s, "files_move", 1.0, 30)      # always solved: no GRPO signal
    _feed(s, "editor_append", 0.0, 30)   # never solved: none either
    _feed(s, "sheet_sort", 0.5, 30)      # mixed: the signal is here
    assert s.weight("files_move") == s.weight("editor_append") == pytest.approx(0.1)
    assert s.weight("sheet_sort") == pytest.approx(1.0)
    drawn = collections.Counter(s.next().split(":")[2].split("/")[0] for _ in range(3000))
    assert 0.78 < drawn["sheet_sort"] / 3000 < 0.88, drawn  # 1 / 1.2 expected
    assert drawn["files_move"] > 150 and drawn["editor_append"] > 150, "solved families are still looked at"
    # The estimate follows the policy: once files_move starts failing half the time its weight comes back.
    _feed(s, "files_move", 0.5, 12)
    assert s.weight("files_move") > 0.9


def test_curated_instances_are_distinct_seeded_and_continue_after_a_restart():
    a = CuratedSampler("sim:train:sheet_sort*2,files_move", 100, 50, True, seed=7, floor=0.1, halflife_groups=8)
    b = CuratedSampler("sim:train:sheet_sort*2,files_move", 100, 50, True, seed=7, floor=0.1, halflife_groups=8)
    ids = [a.next() for _ in range(60)]
    assert ids == [b.next() for _ in range(60)]
    by_family = collections.defaultdict(list)
    for tid in ids:
        suite, _, n = tid.rpartition("/")
        assert suite in ("sim:train:sheet_sort", "sim:train:files_move") and 100 <= int(n) < 150
        by_family[suite].append(int(n))
    for seeds in by_family.values():
        assert len(set(seeds[:50])) == len(seeds[:50]), "a family's walk visits every seed before repeating"
    assert len(by_family["sim:train:sheet_sort"]) > len(by_family["sim:train:files_move"]), "the suite's weight"
    # Every id names a task the sim can make, of the family it names.
    for tid in ids[:10]:
        assert sim_tasks.make_task(tid).family == tid.split(":")[2].split("/")[0]
    # A broker restart (other start count, other sampling seed) continues each family's walk from the state.
    _feed(a, "sheet_sort", 1.0, 5)
    state = json.loads(json.dumps(a.state()))
    c = CuratedSampler("sim:train:sheet_sort*2,files_move", 100, 50, True, seed=8, floor=0.1, halflife_groups=8,
                       restored=state)
    assert c.success == a.success and c.issued == a.issued
    assert [c.take(f) for f in ("sheet_sort", "files_move")] == [a.take(f) for f in ("sheet_sort", "files_move")]
    # Groups of a task id that is not one of the curated families are ignored, not counted against one.
    c.observe("sim:train/3", [True, False])
    c.observe("sim:train:settings_display/3", [True, False])
    assert c.groups == a.groups


def test_curation_settings_are_checked_when_the_config_loads():
    assert build(TaskSourceConfig, {"curation": "adaptive", "suite": "sim:train"}).curation == "adaptive"
    with pytest.raises(ConfigError, match="curation must be one of"):
        build(TaskSourceConfig, {"curation": "greedy"})
    with pytest.raises(ConfigError, match="name them in broker.tasks.suite"):
        build(TaskSourceConfig, {"curation": "adaptive", "suite": "myenv:train"})
    with pytest.raises(ConfigError, match="curation_floor"):
        build(TaskSourceConfig, {"curation": "adaptive", "curation_floor": 0.0})


def test_replay_settings_are_checked_when_the_config_loads():
    curated = {"curation": "adaptive", "suite": "sim:train"}
    assert build(BrokerConfig, {"replay": "family", "tasks": curated}).replay == "family"
    assert build(BrokerConfig, {"replay": "task"}).replay == "task"
    with pytest.raises(ConfigError, match="replay must be one of"):
        build(BrokerConfig, {"replay": "always"})
    with pytest.raises(ConfigError, match="needs broker.tasks.curation"):
        build(BrokerConfig, {"replay": "family"})  # uncurated task ids do not name their family
    with pytest.raises(ConfigError, match="success_per_task"):
        build(BrokerConfig, {"replay": "task", "success_per_task": 0})
    with pytest.raises(ConfigError, match="group_size >= 2"):
        build(BrokerConfig, {"replay": "task", "group_size": 1})  # replacing the only rollout would leave none played
    with pytest.raises(ConfigError, match="replay_max_age"):
        build(BrokerConfig, {"replay": "task", "replay_max_age": -1})


def test_broker_curates_from_the_groups_it_receives_and_keeps_it_across_a_restart(start_broker, quiet_log,
                                                                                   tmp_path):
    cfg = BrokerConfig(groups_per_batch=4, group_size=2, eta=8, metrics_interval_s=0.2, persist=True,
                       tasks=TaskSourceConfig(suite="sim:train:files_move,sheet_sort", curation="adaptive",
                                              curation_halflife_groups=2.0))
    run_dir = tmp_path / "run"
    tb = start_broker(cfg, run_dir=run_dir)
    actor, learner = clients(tb, quiet_log)
    learner.set_control(0)
    tickets = take_tickets(actor, 12, expect=12)
    assert {t.task_id.rpartition("/")[0] for t in tickets} <= {"sim:train:files_move", "sim:train:sheet_sort"}
    incomplete = next(t for t in tickets if "sheet_sort" in t.task_id)
    for t in tickets:  # files_move always solved, sheet_sort half the time; one group hit an environment error
        rewards = (1.0, 1.0) if "files_move" in t.task_id else (1.0, 0.0)
        actor.submit(make_group(t, rewards=rewards, complete=t is not incomplete))
    pump([actor], 5, until=lambda: len(actor.acks) == 12)
    state = tb.broker.sampler.state()
    n_move = sum("files_move" in t.task_id for t in tickets)
    assert state["files_move"]["groups"] == n_move and state["files_move"]["weight"] < 0.2
    assert state["sheet_sort"]["groups"] == 12 - n_move - 1, "an incomplete group says nothing about the policy"
    assert state["sheet_sort"]["weight"] == pytest.approx(1.0)
    pump([actor], 0.5)
    records = [json.loads(x) for x in (tb.run_dir.metrics / "broker.jsonl").read_text().splitlines()]
    assert records[-1]["curation"]["files_move"]["groups"] == n_move, "the metrics show the curation"
    # The estimates are written with the learner's commits (the broker's durable state), so a restarted broker
    # continues from the last one: at most a learner step's worth of outcomes is forgotten.
    learner.grant(1)
    batch = learner.next_batch(5)
    learner.settle([g.group_id for g in batch.groups])
    learner.checkpoint_durable(1)
    pump([learner], 5, until=lambda: learner.commits_confirmed == 1)
    actor.close()
    learner.close()
    tb.stop()
    tb2 = start_broker(cfg, run_dir=run_dir)
    assert tb2.broker.sampler.state() == state, "curation survives a broker restart"
    tb2.stop()
