"""Behaviour cloning: demos become samples with the actors' prompt layout; the result loads and evaluates."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from actor.demos import record_demos  # noqa: E402
from actor.prompt import EpisodePrompt, PromptConfig  # noqa: E402
from common import log as L  # noqa: E402
from policy.model import ModelConfig  # noqa: E402
from policy.tokenizer import ByteTokenizer  # noqa: E402
from launch.evaluate import evaluate, suite_tasks  # noqa: E402
from launch.pretrain import PretrainConfig, demo_trajectories, pretrain  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_demo_samples_are_what_an_actor_would_have_prompted():
    tok = ByteTokenizer()
    pc = PromptConfig(style="minimal", max_prompt_tokens=1024)
    cfg = PretrainConfig(families=["files_rename"], seeds=3, route="gui")
    trajs = demo_trajectories(cfg, pc, tok)
    assert len(trajs) == 3 and all(t.success for t in trajs)
    t = trajs[0]
    first = t.turn(0)
    assert tok.decode(first.output_ids.tolist()).startswith("open_app(") and first.output_ids[-1] == tok.eos_id
    # the second prompt holds the first action's ids verbatim, as an actor's prompt would
    second = t.turn(1).prompt_ids.tolist()
    ids = first.output_ids.tolist()
    assert any(second[i:i + len(ids)] == ids for i in range(len(second)))
    assert EpisodePrompt(tok, pc, "x").head[0].role == "user", "minimal style: no system block"


def test_recorded_demos_follow_the_suite_and_reject_bad_arguments():
    tok, pc = ByteTokenizer(), PromptConfig(style="minimal")
    demos = record_demos("sim:train:settings_display,editor_replace", 4, pc, tok)
    actions = [d.turn(0).action for d in demos]
    assert len(demos) == 4 and all(d.success for d in demos)
    assert [a.split(".")[0] for a in actions] == ["Settings", "Editor", "Settings", "Editor"], actions
    assert record_demos("sim:train:settings_display,editor_replace", 4, pc, tok)[3].turn(0).action == actions[3]
    with pytest.raises(Exception, match="unknown family"):
        record_demos("sim:train:no_such_family", 1, pc, tok)
    with pytest.raises(ValueError, match="route"):
        record_demos("sim:train", 1, pc, tok, route="teleport")


def test_run_demos_are_recorded_once_into_the_run_directory_and_refused_for_other_settings(tmp_path):
    import os

    import click

    from actor.demos import record_run_demos
    from common import demofile
    from common.rundir import RunDir
    from launch.cli.role_commands import _run_demos
    from launch.config import load_run_config

    cfg = load_run_config(None)
    cfg.actor.prompt = PromptConfig(style="minimal")
    rd = RunDir.create(tmp_path / "run")
    assert record_run_demos(cfg, rd) == {} and _run_demos(cfg, rd, "anchor") is None, "no set enabled: none"
    cfg.learner.anchor.suite, cfg.learner.anchor.demos = "sim:train:settings_display,editor_replace", 3
    cfg.actor.workflows.suite, cfg.actor.workflows.demos = "sim:train:files_delete", 2
    with pytest.raises(click.ClickException, match="computerrl demos"):
        _run_demos(cfg, rd, "anchor")  # the learner does not play desktops: no file, a clear error
    assert record_run_demos(cfg, rd) == {"anchor": 3, "workflows": 2}
    first = os.stat(rd.demos("anchor"))
    assert record_run_demos(cfg, rd) == {"anchor": 3, "workflows": 2}
    assert os.stat(rd.demos("anchor")).st_ino == first.st_ino, "kept, not redone"
    loaded = _run_demos(cfg, rd, "anchor")
    expected = record_demos(cfg.learner.anchor.suite, 3, cfg.actor.prompt, ByteTokenizer(), seed=0)
    assert [(t.prompt_ids.tolist(), t.output_ids.tolist()) for t in loaded] == \
        [(t.prompt_ids.tolist(), t.output_ids.tolist()) for t in expected]
    workflows = _run_demos(cfg, rd, "workflows")
    assert [d.traj_id for d in workflows] == ["demo/sim:train:files_delete/0", "demo/sim:train:files_delete/1"]
    assert all(d.trees and d.turn(0).action.startswith(("click(", "open_app(", "double_click(")) for d in workflows), \
        "workflow demos take the gui route, with their trees"
    cfg.actor.prompt.history_turns = 1  # the prompts changed: those demos are not this run's
    with pytest.raises(click.ClickException, match="other settings"):
        _run_demos(cfg, rd, "anchor")
    assert record_run_demos(cfg, rd)["anchor"] == 3 and os.stat(rd.demos("anchor")).st_ino != first.st_ino
    rd.demos("anchor").write_bytes(b"\x93garbage")
    with pytest.raises(demofile.DemoFileError, match="not a demonstrations file"):
        demofile.load(rd.demos("anchor"), demofile.run_demo_sets(cfg)["anchor"])


def test_eval_plays_each_family_of_a_weighted_suite_once():
    assert suite_tasks("sim:heldout:sheet_sort*3,editor_replace", 2) == [
        "sim:heldout:sheet_sort/0", "sim:heldout:sheet_sort/1", "sim:heldout:editor_replace/0",
        "sim:heldout:editor_replace/1"], "a training weight does not change what eval plays"


@pytest.mark.slow
def test_pretrain_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    log = L.setup("test", "test", 0, None, "warning", quiet=True)
    cfg = PretrainConfig(families=["settings_display"], seeds=40, steps=25, batch_samples=16, lr=6e-3, warmup_steps=2)
    pc = PromptConfig(style="minimal", max_prompt_tokens=768)
    losses = []
    # model.path names the run's starting checkpoint; a scratch pretrain ignores it and must not record it.
    from_run = ModelConfig(**{**TINY.__dict__, "path": str(tmp_path / "some-base")})
    out = pretrain(cfg, from_run, pc, tmp_path / "base", log, lambda s, n, loss: losses.append(loss))
    assert out["checkpoint"] == str(tmp_path / "base") and (tmp_path / "base" / "config.json").exists()
    assert not (tmp_path / "base" / "trainer.pt").exists(), "a policy directory: weights only"
    import json

    state = json.loads((tmp_path / "base" / "state.json").read_text())
    assert state["model_config"]["tokenizer_path"] == "", "a byte-tokenizer base names no host path"
    assert losses[-1] < losses[0] * 0.7, losses
    from actor.engine import EngineConfig
    from actor.hf_engine import HFEngine
    from actor.engine import SamplingParams

    eng = HFEngine(ModelConfig(**{**TINY.__dict__, "path": out["checkpoint"]}), EngineConfig())
    res = evaluate(eng, suite_tasks("sim:heldout:settings_display", 2), pc, SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=40), 4)
    assert res["episodes"] == 2 and "settings_display" in res["per_family"]
    from launch.config import config_for_checkpoint
    from launch.evaluate import load_policy

    cloned = load_policy(out["checkpoint"], config_for_checkpoint(out["checkpoint"]))
    assert cloned[1] == pc, "eval rebuilds the prompts the policy was cloned on"
    # A second stage continues from the first (init: model) and records it.
    more = []
    stage2 = dataclasses.replace(cfg, init="model", steps=5, seed=1)
    pretrain(stage2, ModelConfig(**{**TINY.__dict__, "path": out["checkpoint"]}), pc, tmp_path / "base2", log,
             lambda s, n, loss: more.append(loss))
    assert more[0] < losses[0] * 0.7, "stage 2 starts from stage 1's weights, not from scratch"
    record = json.loads((tmp_path / "base2" / "state.json").read_text())["pretrain"]
    assert record["init"] == "model" and record["started_from"]["steps"] == 25 and record["started_from"]["init"] == "scratch"


def test_pretrain_device_is_validated():
    PretrainConfig(device="cuda:1").validate()
    with pytest.raises(ValueError, match="pretrain.device"):
        PretrainConfig(device="gpu").validate()
    with pytest.raises(ValueError, match="pretrain.device"):
        PretrainConfig(device="cuda:one").validate()
