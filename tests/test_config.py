"""Config loading: YAML + dotted overrides into typed dataclasses; unknown keys named; docs on every field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest
import yaml
from click.testing import CliRunner

from common import config as configlib
from common.config import ConfigError
from launch.cli import main
from launch.config import RunConfig, load_run_config, resolve_run_dir
from tests.conftest import REPO, whole_checkpoint

REPO_CONFIG = REPO / "configs" / "local.yaml"


def test_shipped_configs_load():
    from pathlib import Path

    for path in Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"):
        load_run_config(path)


def test_overrides_typed_and_nested(tmp_path):
    cfg = load_run_config("configs/local.yaml", ["broker.eta=4", "broker.tasks.suite=sim:heldout", "net.heartbeat_s=2",
                                                 "broker.persist=false", "run.run_id=007", "learner.lr=5e-5"])
    assert cfg.learner.lr == 5e-5, "YAML 1.1 reads 5e-5 as a string; a float field takes it as the number"
    assert cfg.broker.eta == 4 and isinstance(cfg.net.heartbeat_s, float) and cfg.net.heartbeat_s == 2.0
    assert cfg.broker.tasks.suite == "sim:heldout" and cfg.broker.persist is False
    assert cfg.run.run_id == "007"  # a str field keeps exactly what was typed


@pytest.mark.parametrize("override,needle", [
    ("broker.etaa=1", "broker.etaa"),
    ("broker.tasks.sweet=1", "broker.tasks.sweet"),
    ("nope.x=1", "nope"),
    ("broker.eta=many", "broker.eta"),
    ("broker.persist=3", "broker.persist"),
    ("net.curve=maybe", "net.curve"),
    ("learner.lr=fast", "learner.lr"),
    ("broker.eta=-1", "eta"),
    ("broker", "key=value"),
    ("broker.drop_zero_variance=true", "renamed broker.dynamic_sampling"),  # a key that moved says where
    ("broker.drop_incomplete=false", "always dropped"),
])
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(configlib.ConfigError) as err:
        load_run_config(None, [override])
    assert needle in str(err.value)


def test_dynamic_sampling_is_refused_where_turn_rewards_could_still_teach():
    """The broker judges a group by its episode rewards; with step-level advantages that could drop a group whose
    turns still rank one another."""
    load_run_config(None, ["broker.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="dynamic_sampling.*level is step"):
        load_run_config(None, ["broker.dynamic_sampling=true", "learner.advantage.level=step"])


def test_cross_policy_share_and_source_come_together_and_a_relative_source_is_made_absolute(tmp_path, monkeypatch):
    base = REPO / "configs" / "local.yaml"
    for overrides, needle in ((["broker.cross_policy_share=0.25"], "actor.cross_policy names none"),
                              (["actor.cross_policy=initial"], "would never play"),
                              (["broker.cross_policy_share=0.25", f"actor.cross_policy={tmp_path}"], "no saved policy"),
                              (["broker.cross_policy_share=0.9", "broker.group_size=1", "actor.cross_policy=initial"],
                               "rounds to 0, or the group has one rollout"),
                              (["broker.cross_policy_share=1", "actor.cross_policy=initial"], "must be in")):
        with pytest.raises(ConfigError, match=needle):
            load_run_config(base, overrides)
    monkeypatch.chdir(REPO)
    cfg = load_run_config(base, ["broker.cross_policy_share=0.25", "actor.cross_policy=configs/base-policy"])
    assert cfg.actor.cross_policy == str(REPO / "configs" / "base-policy") and cfg.broker.cross_policy_slots() == 2


def test_workflow_exploration_is_checked_against_the_tasks_the_groups_and_the_learner():
    base = REPO / "configs" / "local.yaml"
    on = "actor.workflows.suite=sim:train:files_delete"
    for overrides, needle in (([on, "broker.group_size=2", "actor.workflows.slots=2"], "leaves the current policy"),
                              ([on, "broker.group_size=4", "broker.cross_policy_share=0.5", "actor.cross_policy=initial",
                                "actor.workflows.slots=2"], "2 cross-policy"),
                              ([on, "learner.explored_coef=0"], "would train nothing"),
                              (["actor.workflows.suite=sim:train:no_such"], "actor.workflows.suite"),
                              (["actor.workflows.suite=desk:train"], "different kinds of task"),
                              ([on, "actor.workflows.demos=0"], "demos >= 1")):
        with pytest.raises(ConfigError, match=needle):
            load_run_config(base, overrides)
    cfg = load_run_config(base, [on, "broker.group_size=4", "actor.workflows.slots=3"])
    assert cfg.actor.workflows.enabled and cfg.actor.workflows.explorer.lr == 1.0


def test_unknown_key_in_yaml_named_with_path(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"broker": {"tasks": {"sute": "x"}}}))
    with pytest.raises(configlib.ConfigError, match=r"broker\.tasks\.sute"):
        load_run_config(p)


def test_a_bare_yaml_off_in_a_string_key_says_to_quote_it(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("broker:\n  tasks:\n    curation: off\n")
    with pytest.raises(configlib.ConfigError, match=r"broker\.tasks\.curation.*quote the word"):
        load_run_config(p)
    p.write_text('broker:\n  tasks:\n    curation: "off"\n')
    assert load_run_config(p).broker.tasks.curation == "off"


def _all_config_classes(cls, seen=None):
    seen = seen if seen is not None else set()
    if cls in seen:
        return seen
    seen.add(cls)
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp):
            _all_config_classes(tp, seen)
    return seen


def test_every_config_field_has_a_one_line_docstring():
    for cls in _all_config_classes(RunConfig):
        docs = configlib.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert "\n" not in docs[f.name], f"{cls.__name__}.{f.name}: docstring is not one line"


def test_resolved_config_written_and_reloadable(tmp_path):
    cfg = load_run_config("configs/local.yaml", ["broker.eta=3"])
    rd = resolve_run_dir(cfg, str(tmp_path / "r"))
    configlib.dump(cfg, rd.config)
    again = load_run_config(rd.config)
    assert configlib.to_dict(again) == configlib.to_dict(cfg) and again.broker.eta == 3 and again.run.run_id == "r"


def test_cli_config_print_and_describe():
    r = CliRunner().invoke(main, ["config", "-c", "configs/local.yaml", "broker.eta=5"])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.output)["broker"]["eta"] == 5
    r = CliRunner().invoke(main, ["config", "--describe"])
    assert r.exit_code == 0 and "broker.eta" in r.output and "staleness" in r.output
    r = CliRunner().invoke(main, ["config", "broker.bogus=1"])
    assert r.exit_code != 0 and "broker.bogus" in r.output


def test_broker_and_env_server_roles_do_not_import_torch():
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys, launch.cli, launch.config, broker.server, env_server.server, actor.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1000:]


def test_relative_model_path_is_found_next_to_the_config_and_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "cfgs" / "policy").mkdir(parents=True)
    (tmp_path / "cfgs" / "c.yaml").write_text("model:\n  path: policy\n")
    (tmp_path / "cfgs" / "missing.yaml").write_text("model:\n  path: not-made-yet\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_run_config(tmp_path / "cfgs" / "c.yaml").model.path == str((tmp_path / "cfgs" / "policy").resolve())
    assert load_run_config(tmp_path / "cfgs" / "missing.yaml").model.path == "not-made-yet"
    assert load_run_config("../cfgs/c.yaml", ["model.path=../cfgs/policy"]).model.path == str(
        (tmp_path / "cfgs" / "policy").resolve()), "an override is taken from the working directory"
    assert load_run_config(REPO_CONFIG).model.path.endswith("configs/base-policy")


def test_a_local_run_sizes_the_desktop_pool_and_weight_rounds_to_its_actors():
    from launch.local import fit_to_local_run

    cfg = load_run_config(REPO_CONFIG, ["env_server.pool_size=4", "local.actors=3", "actor.max_groups=2",
                                        "broker.group_size=8", "learner.expected_actors=0"])
    notes = fit_to_local_run(cfg)
    assert cfg.env_server.pool_size == 48 and cfg.learner.expected_actors == 3 and "48" in notes[0]
    big = load_run_config(REPO_CONFIG, ["env_server.pool_size=64", "learner.expected_actors=1"])
    assert fit_to_local_run(big) == [] and big.env_server.pool_size == 64 and big.learner.expected_actors == 1


def test_resume_refuses_a_run_directory_without_a_checkpoint_and_names_those_that_have_one(tmp_path):
    """A mistyped --run-dir on a requeue used to start a new run from scratch, exit 0, with only a log warning."""
    runs = tmp_path / "runs"
    whole_checkpoint(runs / "good" / "checkpoints", 4)
    out = CliRunner().invoke(main, ["run", str(REPO / "configs" / "local.yaml"), "--run-dir", str(runs / "godo"),
                                    "--resume"])
    assert out.exit_code == 2, out.output
    assert f"{runs / 'godo'} holds no checkpoint" in out.output and "good" in out.output, out.output
    assert not (runs / "godo").exists(), "nothing was started or created"


def test_a_new_run_in_a_directory_whose_run_has_checkpoints_is_refused(tmp_path):
    """`run` into a run's directory with --resume left out started a second run there: its learner counted versions
    from 0 beside the old checkpoints, took the old run's queued groups, drew both runs into one curve, and the
    rotation (which keeps the highest versions) deleted its own latest checkpoint. Refused now, nothing written."""
    run = tmp_path / "run"
    whole_checkpoint(run / "checkpoints", 40)
    for where in (["--run-dir", str(run)], [f"run.run_id={run.name}", f"run.run_dir={run}"]):
        out = CliRunner().invoke(main, ["run", str(REPO / "configs" / "local.yaml"), *where])
        assert out.exit_code == 2, out.output
        assert f"{run} holds a run with checkpoints (the latest: step-00000040): continue it with --resume" \
            in out.output, out.output
    assert not (run / "config.yaml").exists(), "nothing was written there"
    from launch.config import check_fresh

    check_fresh(tmp_path / "empty")  # a new directory, or one killed before its first checkpoint: a new run
    # its latest checkpoint moved away by hand: still a run with checkpoints (the older ones), not a new run's place
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-00000040")
    with pytest.raises(ValueError, match="holds a run with checkpoints .the latest: step-00000040."):
        check_fresh(run)


def _a_run_started_with(tmp_path, overrides):
    """A run directory as `computerrl run configs/local.yaml OVERRIDES` leaves it (configs written, one checkpoint)."""
    from launch.cli.base import prepare_run

    run = tmp_path / "run"
    prepare_run(load_run_config(REPO_CONFIG, overrides), str(run))
    whole_checkpoint(run / "checkpoints", 4)
    return run


def test_a_resume_continues_the_runs_own_config_with_this_commands_overrides_on_top(tmp_path):
    """`run configs/local.yaml --run-dir R --resume` (README's "continue a run") took the recipe file as given, so the
    overrides the run had started with were lost without a word: a finished 4-step run trained on to the recipe's 40
    steps with periodic evaluation switched on, and a run started with learner.total_steps=100 would "finish" at 40."""
    from launch.config import resumed_config
    from launch.local import fit_to_local_run

    run = _a_run_started_with(tmp_path, ["learner.total_steps=4", "local.eval_episodes=0", "local.actors=1"])
    cfg, notes = resumed_config(REPO_CONFIG, [], run)
    assert (cfg.learner.total_steps, cfg.local.eval_episodes, cfg.local.actors) == (4, 0, 1)
    assert cfg.run.run_id == "run" and len(notes) == 1, notes
    assert "learner.total_steps 4 (run) / 40" in notes[0] and "local.eval_episodes 0 (run) / 25" in notes[0] \
        and "not applied" in notes[0], notes

    # An override on the resume changes the run, and says so; the local shape is derived again from what was asked
    # (config.yaml holds learner.expected_actors 1, derived from local.actors=1: a base of it would keep 1).
    cfg, notes = resumed_config(REPO_CONFIG, ["learner.total_steps=8", "local.actors=3"], run)
    assert cfg.learner.total_steps == 8 and notes[:2] == ["this resume changes learner.total_steps: 4 -> 8",
                                                          "this resume changes local.actors: 1 -> 3"], notes
    assert "learner.total_steps" not in notes[2] and "local.actors" not in notes[2], notes
    fit_to_local_run(cfg)
    assert cfg.learner.expected_actors == 3
    assert load_run_config(run / "config.yaml").learner.expected_actors == 1

    # The Slurm script resumes from the run's own config.yaml: nothing differs, nothing to say.
    assert resumed_config(run / "config.yaml", [], run)[1] == []
    # A run directory from before config.requested.yaml was kept resumes from its config.yaml, which was fitted to the
    # run's shape: the config it is compared with is fitted too, so what differs is said as the run would have it.
    (run / "config.requested.yaml").unlink()
    cfg, notes = resumed_config(REPO_CONFIG, [], run)
    assert cfg.learner.total_steps == 4 and len(notes) == 1, notes
    assert "learner.expected_actors 1 (run) / 2, learner.total_steps 4 (run) / 40, local.actors 1 (run) / 2" \
        in notes[0], notes


@pytest.mark.parametrize("override, says", [
    ("model.path=/elsewhere/policy", "model.path: the run has '"),
    ("model.tokenizer=hf", "model.tokenizer: the run has 'auto', this resume gives 'hf'"),
    ("run.run_id=other", "run.run_id: the run has 'run', this resume gives 'other'"),
])
def test_a_resume_that_would_change_the_runs_model_or_id_is_refused_before_anything_starts(tmp_path, override, says):
    """Its checkpoints hold that model's weights and its spill log that tokenizer's token ids."""
    run = _a_run_started_with(tmp_path, ["learner.total_steps=4"])
    written = (run / "config.yaml").read_text()
    out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), override, "--run-dir", str(run), "--resume"])
    assert out.exit_code == 2 and says in out.output and "keeps its model, tokenizer and run id" in out.output, \
        out.output
    assert (run / "config.yaml").read_text() == written and not (run / "logs" / "broker-0.log").exists()


def test_a_resume_may_change_a_config_built_models_shape_only_where_the_run_has_no_checkpoint_path(tmp_path):
    from launch.config import resumed_config

    run = _a_run_started_with(tmp_path, [])  # model.path set: the shape fields are not read
    assert resumed_config(REPO_CONFIG, ["model.hidden_size=32"], run)[0].model.hidden_size == 32
    built = _a_run_started_with(tmp_path / "built", ["model.path="])
    with pytest.raises(ConfigError, match="model.hidden_size: the run has 128, this resume gives 32"):
        resumed_config(REPO_CONFIG, ["model.path=", "model.hidden_size=32"], built)


@pytest.mark.parametrize("key, suite, says", [
    ("broker.tasks.suite", "sim:train:nope", r"unknown family 'nope'; families: .*sheet_sort"),
    ("local.eval_suite", "sim:test", "split must be one of"),
    ("learner.anchor.suite", "sim:train:files_delete,nope", "unknown family 'nope'"),
])
def test_a_suite_naming_what_the_backend_lacks_is_refused_at_config_load(key, suite, says):
    """A run whose suite named a family that does not exist played nothing for minutes while looking busy."""
    with pytest.raises(ConfigError, match=says):
        load_run_config(REPO_CONFIG, [f"{key}={suite}"])


def test_a_missing_optional_package_is_named_with_its_extra_not_as_an_unknown_family():
    probe = ("import sys; sys.modules['miniwob'] = None\n"  # as if the miniwob extra were not installed
             "from env_server.backend_registry import task_registry\n"
             "task_registry('miniwob', 'env_server.miniwob:PLUGIN').parse_suite('miniwob:train:enter-text')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "miniwob tasks need the miniwob package: pip install 'computerrl[miniwob]'" \
        in out.stderr, out.stderr[-1500:]


@pytest.mark.parametrize("key, name, says", [
    ("learner.loss.name", "no_such_pkg.losses:my_loss", r"learner.loss.name: cannot load 'no_such_pkg.losses:my_loss'"),
    ("learner.loss.name", "learner.example_loss:no_such_fn", r"cannot load 'learner.example_loss:no_such_fn'"),
    ("learner.advantage.name", "learner.losses:LOSSES", r"learner.advantage.name: .* is a dict, not a function"),
])
def test_a_name_loaded_by_import_path_is_imported_at_config_load(key, name, says):
    """A custom loss that did not import was found 68 s into a run, after six learner exits, with groups acked."""
    with pytest.raises(ConfigError, match=says):
        load_run_config(REPO_CONFIG, [f"{key}={name}"])
    out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), f"{key}={name}"])
    assert out.exit_code == 2 and ("cannot load" in out.output or "not a function" in out.output), out.output


def test_one_key_moves_every_port_of_a_local_run():
    from launch.local import PORT_KEYS, fit_to_local_run

    cfg = load_run_config(REPO / "configs" / "local.yaml", ["local.port_base=31000"])
    notes = fit_to_local_run(cfg)
    ports = [getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in PORT_KEYS]
    assert ports == list(range(31000, 31000 + len(PORT_KEYS))) and any("local.port_base" in n for n in notes)
    assert cfg.actor.env_servers == [f"127.0.0.1:{cfg.env_server.port}"]
    with pytest.raises(ConfigError, match="port_base"):
        load_run_config(None, ["local.port_base=80"])


def test_a_run_on_ports_another_run_listens_on_is_refused_before_it_starts(tmp_path):
    """Two local runs on the same ports: the second one's readiness probe took a Ready from the first one's broker
    (no CURVE on loopback), and its learner and actors joined the first run (its tickets, desktops and weights).
    Now `run` refuses such ports before it makes anything, naming the key; a port a finished run left in TIME_WAIT
    is taken as free, as the servers' SO_REUSEADDR binds take it."""
    import shutil
    import socket

    from launch.local import check_ports_free, free_port_overrides

    ports = free_port_overrides()
    taken = int(ports[0].split("=")[1])
    with socket.create_server(("127.0.0.1", taken)):  # another run's broker
        out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), *ports, "--run-dir", str(tmp_path / "second")])
    assert out.exit_code == 2, out.output
    assert f"net.broker_front_port={taken}: something on this machine already listens there" in out.output
    assert "local.port_base" in out.output and not (tmp_path / "second").exists()
    # The same port after a run that served a connection on it ended: its side closed first, so TIME_WAIT.
    with socket.create_server(("127.0.0.1", taken)) as server:
        client = socket.create_connection(("127.0.0.1", taken))
        served, _ = server.accept()
        served.close()
        client.close()
    check_ports_free(load_run_config(REPO_CONFIG, ports))
    assert any(f":{taken} " in line and "TIME-WAIT" in line
               for line in subprocess.run(["ss", "-tan"], capture_output=True, text=True).stdout.splitlines()) \
        or not shutil.which("ss"), "the port is in TIME_WAIT, as a finished run leaves it"


def test_a_checkpoint_or_tokenizer_that_is_not_there_is_refused_before_any_role_starts(tmp_path):
    """A mistyped model.path let every role start, then failed the learner and both actors five times each before
    the run gave up (a minute, and "resumable" said of a run that could never start). A mistyped tokenizer_path was
    worse: the auto tokenizer found no files there and took the byte tokenizer, silently. Both are refused now by
    `run`, `slurm submit` and `sweep` (here `run`: exit 2, no run directory made), while `pretrain`, which may be
    about to write model.path, still loads the config."""
    import torch
    from safetensors.torch import save_file

    empty = tmp_path / "empty"
    empty.mkdir()
    cut = tmp_path / "cut"  # a policy copied in part: its roles crashed loading it at every restart
    cut.mkdir()
    (cut / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1000)}, str(cut / "model.safetensors"))
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    cases = [(f"model.path={tmp_path / 'nope'}", "no checkpoint there"),
             (f"model.path={cut}", f"model.path {str(cut)!r}: its weights are damaged: model.safetensors: "
                                   f"{len(data) - 100} bytes where its header says {len(data)}"),
             (f"model.tokenizer_path={empty}", "no tokenizer there"),
             ("model.tokenizer=hf", "model.tokenizer is hf, and neither")]
    for override, says in cases:
        run_dir = tmp_path / "run"
        out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), override, "--run-dir", str(run_dir)])
        assert out.exit_code == 2 and says in out.output, (override, out.output)
        assert not run_dir.exists(), "nothing was started or created"
        out = CliRunner().invoke(main, ["slurm", "submit", str(REPO_CONFIG), override, "--dry-run"])
        assert out.exit_code != 0 and says in out.output, (override, out.output)
        out = CliRunner().invoke(main, ["sweep", str(REPO_CONFIG), "--vary", "learner.lr=1e-4,2e-4", override,
                                        "--out", str(tmp_path / "sweep")])
        assert out.exit_code != 0 and says in out.output, (override, out.output)
        load_run_config(REPO_CONFIG, [override])  # the config itself loads: pretrain may be making the checkpoint
    load_run_config(REPO_CONFIG, []).model.check_files()  # the shipped base policy (byte tokenizer, no files) is fine


def test_a_device_or_engine_this_machine_lacks_is_a_config_error_here_and_left_to_the_nodes_under_slurm(
        tmp_path, monkeypatch):
    """learner.device=cuda on a machine without one crashed the learner five times (90 s) before the run gave up;
    actor.engine.kind=vllm without vLLM did the same to every actor. `run` refuses them before starting anything;
    `slurm submit` does not, since its roles start on GPU nodes the login node is not, where each role checks for
    itself (exit 78)."""
    import torch

    from policy.device import check_device

    for override, says in [("learner.device=cuda", "learner.device=cuda: "),
                           ("actor.engine.device=cuda:0", "actor.engine.device=cuda:0: "),
                           ("actor.engine.kind=vllm", "actor.engine.kind=vllm needs vLLM")]:
        out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), override, "--run-dir", str(tmp_path / "run")])
        assert out.exit_code == 2 and says in out.output, (override, out.output)
        assert not (tmp_path / "run").exists()
    out = CliRunner().invoke(main, ["slurm", "submit", str(REPO_CONFIG), "learner.device=cuda", "--dry-run"])
    assert out.exit_code == 0 and "#SBATCH" in out.output, out.output
    # every answer check_device can give, on a torch with CUDA built in and 0 or 2 GPUs visible
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"learner.device=cuda: no CUDA GPU is visible .*CUDA_VISIBLE_DEVICES ''"):
        check_device("learner.device", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("learner.device", "cuda")
    check_device("learner.device", "cuda:1")
    with pytest.raises(ConfigError, match=r"cuda:2: 2 CUDA GPU\(s\) visible .*indices 0..1"):
        check_device("learner.device", "cuda:2")
    with pytest.raises(ConfigError, match="not a device"):
        check_device("learner.device", "gpu")
    check_device("learner.device", "cpu")


def test_groups_of_one_rollout_are_refused_where_nothing_could_train():
    """broker.group_size=1 under the default estimator ran 40 empty steps (every group dropped for tied rewards) and
    said "finished". Refused wherever a group-relative estimator or a zero-variance rule needs two rollouts; kept
    where nothing compares within a group (the batch estimator, nothing dropped) or turns do (step level)."""
    for overrides, names in [([], ["advantage.name=group", "drop_zero_variance"]),
                             (["learner.advantage.name=rloo", "learner.advantage.drop_zero_variance=false"],
                              ["advantage.name=rloo"]),
                             (["learner.advantage.name=batch"], ["drop_zero_variance"]),
                             (["learner.advantage.name=batch", "learner.advantage.drop_zero_variance=false",
                               "broker.dynamic_sampling=true"], ["broker.dynamic_sampling"])]:
        with pytest.raises(ConfigError, match="broker.group_size=1: a group of one rollout") as err:
            load_run_config(REPO_CONFIG, ["broker.group_size=1", *overrides])
        assert all(n in str(err.value) for n in names), (overrides, str(err.value))
    load_run_config(REPO_CONFIG, ["broker.group_size=1", "learner.advantage.name=batch",
                                  "learner.advantage.drop_zero_variance=false"])
    load_run_config(REPO_CONFIG, ["broker.group_size=1", "learner.advantage.level=step"])


@pytest.mark.parametrize("overrides, says", [
    (["learner.lr=-1e-4"], "need lr > 0"),
    (["learner.total_steps=-1"], "total_steps"),
    (["learner.keep_checkpoints=0"], "keep_checkpoints >= 1"),
    (["actor.max_steps=-1"], "max_steps >= 0"),
    (["env_server.port=25555"], "net.broker_front_port and env_server.port are both 25555"),
])
def test_values_that_ran_without_a_word_and_did_the_wrong_thing_are_refused(overrides, says):
    """A negative learning rate ascended the loss; two listeners on one port failed to bind at every restart."""
    with pytest.raises(ConfigError, match=says):
        load_run_config(REPO_CONFIG, overrides)
    if "port" in says:  # numbered by the run itself, the keys' own values no longer matter
        load_run_config(REPO_CONFIG, [*overrides, "local.port_base=30000"])


def test_demonstrations_are_recorded_for_a_checkpoint_not_made_yet_but_not_with_a_tokenizer_that_is_not_there(
        tmp_path):
    """`computerrl demos` tokenizes, it loads no model: a recipe records them before it pretrains the checkpoint
    model.path names (configs/miniwob-wge.yaml), and the first version of the pre-start checks refused that (exit
    78). A tokenizer_path with no tokenizer in it is refused: the demos would be the byte tokenizer's."""
    empty = tmp_path / "empty"
    empty.mkdir()
    command = [sys.executable, "-m", "launch.cli", "demos", "-c", str(REPO_CONFIG), "--run-dir", str(tmp_path / "run"),
               f"model.path={tmp_path / 'made-later'}", "learner.anchor.demos=4", "run.log_level=warning"]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "4 demonstrations (anchor)" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*command, f"model.tokenizer_path={empty}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 78 and "no tokenizer there" in out.stderr, out.stdout + out.stderr


def test_a_run_directory_that_cannot_be_written_is_refused_with_its_path_not_a_traceback(tmp_path):
    """Found by hand on a read-only mount (2026-12-03): `run`, `run --resume` and each role ended in an OSError's
    traceback. Here a file stands where the run directory would be made."""
    (tmp_path / "a-file").write_text("")
    where = tmp_path / "a-file" / "run"
    out = CliRunner().invoke(main, ["run", str(REPO_CONFIG), "--run-dir", str(where)])
    assert out.exit_code == 1 and f"the run directory {where} cannot be written" in out.output, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    import subprocess
    import sys

    role = subprocess.run([sys.executable, "-m", "launch.cli", "broker", "--config", str(REPO_CONFIG), "--run-dir",
                           str(where)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert role.returncode == 78, role.stderr  # (EXIT_CONFIG: its supervisor does not start it again)
    assert f"the run directory {where} cannot be written" in role.stderr and "Traceback" not in role.stderr
