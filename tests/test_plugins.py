"""An environment from outside the repository (docs/examples/lamps_env.py, copied to a folder of its own) selected
by import path: its options checked by it, its tasks solved through it, a `computerrl run` and eval on it."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from env_server.actions import ActionError
from env_server.config import EnvServerConfig
from tests.conftest import REPO

EXAMPLE = REPO / "docs" / "examples" / "lamps_env.py"
NAME = "lamps_env:PLUGIN"


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """The example module in a folder outside the repository, importable as a user's package would be."""
    ext = tmp_path / "ext"
    ext.mkdir()
    shutil.copy(EXAMPLE, ext / "lamps_env.py")
    monkeypatch.syspath_prepend(str(ext))
    sys.modules.pop("lamps_env", None)
    yield ext
    sys.modules.pop("lamps_env", None)


def test_the_plugin_checks_its_options_and_bad_names_fail_clearly(outside):
    EnvServerConfig(backend=NAME, options={"max_steps": 3}).validate()
    with pytest.raises(ValueError, match=r"unknown config key 'env_server\.options\.colour' \(known keys here: max_steps\)"):
        EnvServerConfig(backend=NAME, options={"colour": "red"}).validate()
    with pytest.raises(ValueError, match=r"'env_server\.options\.max_steps': expected an integer"):
        EnvServerConfig(backend=NAME, options={"max_steps": "many"}).validate()
    with pytest.raises(ValueError, match="names LampPanel, not an env_server.backend_registry.Plugin"):
        EnvServerConfig(backend="lamps_env:LampPanel").validate()
    with pytest.raises(ValueError, match="cannot load 'no_such_env:PLUGIN'"):
        EnvServerConfig(backend="no_such_env:PLUGIN").validate()
    with pytest.raises(ValueError, match="env_server.options is for a backend from outside"):
        EnvServerConfig(backend="sim", options={"max_steps": 3}).validate()
    # A suite naming a family the plug-in lacks is refused at config load, with the families it has.
    from launch.config import load_run_config
    with pytest.raises(ValueError, match=r"broker.tasks.suite 'lamps:train:nope'.*unknown family 'nope'; families: lamp"):
        load_run_config(REPO / "configs" / "local.yaml", [f"env_server.backend={NAME}", "learner.anchor.suite=",
                                                         "broker.tasks.suite=lamps:train:nope",
                                                         "local.eval_suite=lamps:heldout"])


def test_every_family_is_solved_through_the_backend_and_bad_actions_are_errors_not_crashes(outside):
    from env_server.backend_registry import make_backend, task_registry
    from launch.evaluate import suite_tasks

    lamps = importlib.import_module("lamps_env")
    env = make_backend(EnvServerConfig(backend=NAME, options={}), seed=0)
    tasks = task_registry("lamps", NAME)
    assert tasks is lamps.TASKS
    ids = suite_tasks("lamps:train", 6, NAME) + suite_tasks("lamps:heldout", 6, NAME)
    assert len(ids) == 24 and ids[0] == "lamps:train:lamp_on/0" and ids[-1] == "lamps:heldout:all_off/5"
    for task_id in ids:
        env.reset(task_id)
        for action in env.scripted_actions():
            step = env.step(action)
            assert not step.format_error and not step.action_error, (task_id, action, step.obs["last_result"])
        assert step.done and env.evaluate()["success"], task_id
    env.reset("lamps:train:lamp_on/1")
    assert env.step("click(99)").action_error and "no lamp 99" in env.last_result
    assert env.step("open_app('Files')").action_error
    assert env.step("this is not an action").format_error
    with pytest.raises(ActionError, match="bad task id"):
        env.reset("lamps:train:no_family/1")
    with pytest.raises(ValueError, match="runs 'lamps' tasks"):
        task_registry("miniwob", NAME)


def test_demonstrations_come_from_the_plugins_solvers(outside):
    from actor.demos import record_demos
    from actor.prompt import PromptConfig
    from policy.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    demos = record_demos("lamps:train:all_off", 5, PromptConfig(), tok, env=EnvServerConfig(backend=NAME))
    assert len(demos) == 5 and all(d.success and d.reward == 1.0 for d in demos)
    last = demos[0].turn(demos[0].num_turns - 1)
    assert tok.decode(last.output_ids.tolist()).startswith("done()"), "the solver's actions, as a model writes them"
    with pytest.raises(ValueError, match="unknown task kind .lamps.: sim, desk, or the kind of an outside"):
        record_demos("lamps:train", 1, PromptConfig(), tok)


@pytest.mark.slow
def test_a_run_and_an_eval_on_an_environment_from_outside(outside, tmp_path):
    from launch.local import free_port_overrides

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{outside}"}  # what installing one's package does
    args = [sys.executable, "-m", "launch.cli", "run", "configs/local.yaml", *free_port_overrides(),
            f"env_server.backend={NAME}", "env_server.options.max_steps=3", "broker.tasks.suite=lamps:train",
            "learner.anchor.suite=", "learner.total_steps=2", "learner.checkpoint_every=2",
            "weights.join_window_s=0.5", "local.eval_episodes=2", "local.eval_start=false",
            "local.eval_suite=lamps:heldout", "--run-dir", str(run_dir)]
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    served = [json.loads(x) for x in (run_dir / "metrics" / "env_server-0.jsonl").read_text().splitlines()][-1]
    assert served["counters"]["resets"] > 0 and served["counters"].get("sessions_reclaimed", 0) == 0
    evals = [json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 2 and set(evals[-1]["per_family"]) == {"lamp_on", "all_off"}
    ev = subprocess.run([sys.executable, "-m", "launch.cli", "eval", "--checkpoint", str(run_dir / "checkpoints"),
                         "--suite", "lamps:heldout:lamp_on", "--episodes", "3", "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["episodes"] == 3 and set(result["per_family"]) == {"lamp_on"}
