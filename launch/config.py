"""The whole-run config: a composition of the per-component configs each package owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from actor.config import ActorConfig
from broker.config import BrokerConfig
from common import config as configlib
from common.metrics.sinks import MetricsConfig
from policy.model import ModelConfig
from common.net import NetConfig
from policy.weightsync import WeightSyncConfig
from env_server.config import EnvServerConfig
from launch.local import PORT_KEYS, LocalConfig, port_of
from launch.pretrain import PretrainConfig
from launch.slurm import SlurmConfig
from learner.config import LearnerConfig
from common.rundir import RunDir, new_run_id


@dataclass
class RunSection:
    """Identity and location of a run."""

    run_id: str = ""
    """run id bound into every log line; empty = generated at start"""
    run_dir: str = "runs/{run_id}"
    """directory for config, logs, metrics, checkpoints, spill log and keys ({run_id} is substituted)"""
    seed: int = 0
    """base random seed of the run"""
    log_level: str = "info"
    """log level of every role (debug, info, warning, error)"""


@dataclass
class RunConfig:
    """Everything a run reads; each role takes only its own sections."""

    run: RunSection = field(default_factory=RunSection)
    """run identity and directory"""
    net: NetConfig = field(default_factory=NetConfig)
    """addresses, CURVE, heartbeats"""
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    """trajectory broker"""
    env_server: EnvServerConfig = field(default_factory=EnvServerConfig)
    """session server and its desktops"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the policy network (the actor's engine and the learner build the same one)"""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """the agent loop of each actor process"""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """weight broadcast from the learner to the actors"""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """the training loop and its algorithm"""
    local: LocalConfig = field(default_factory=LocalConfig)
    """the local supervisor of `computerrl run`"""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    """behaviour cloning on oracle demonstrations (`computerrl pretrain`)"""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """the Slurm batch job of `computerrl slurm submit`"""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """where metric records go besides each role's JSONL (TensorBoard, W&B)"""


def load_run_config(path: str | Path | None, overrides: Iterable[str] = (), check_imports: bool = True) -> RunConfig:
    """The run config from ``path`` (None: the defaults) and dotted ``overrides``, checked. ``check_imports`` False:
    a run's recorded config read for what it says (the live view, an evaluation, forwarding its metrics), where the
    loss or estimator it names by import path need not be importable."""
    cfg = configlib.load(RunConfig, path, overrides)
    # A relative model directory (the policy's, its tokenizer's, the cross policy's) means: from here, or else next
    # to the config file (configs/local.yaml names configs/base-policy as "base-policy"). Made absolute, so every
    # role and a run's saved config.yaml find the same files from any working directory.
    for section, attr in ((cfg.model, "path"), (cfg.model, "tokenizer_path"), (cfg.actor, "cross_policy")):
        value = getattr(section, attr)
        if value and value != "initial" and not Path(value).is_absolute():
            here, beside = Path(value), (Path(path).parent / value if path else None)
            found = here if here.exists() else beside if beside is not None and beside.exists() else None
            if found is not None:  # not there at all: left as written (pretrain may be about to make it)
                setattr(section, attr, str(found.resolve()))
    from env_server.backend_registry import task_kind
    from env_server.families import kind_of

    suite, kind = cfg.broker.tasks.suite, task_kind(cfg.env_server.backend)
    if kind_of(suite) != kind:
        raise configlib.ConfigError(f"broker.tasks.suite {suite!r} names {kind_of(suite)!r} tasks, and "
                                    f"env_server.backend {cfg.env_server.backend!r} runs {kind!r} tasks")
    check_suites(cfg)
    if check_imports:
        check_import_paths(cfg)
    if cfg.broker.dynamic_sampling and cfg.learner.advantage.level == "step":
        raise configlib.ConfigError("broker.dynamic_sampling judges a group by its episode rewards, and "
                                    "learner.advantage.level is step: a group whose episodes tie may still "
                                    "teach through its turn rewards; turn dynamic sampling off")
    shows = cfg.actor.prompt.observation
    if shows != "tree" and cfg.env_server.backend == "sim" and cfg.env_server.sim.screenshot == "none":
        raise configlib.ConfigError(f"actor.prompt.observation {shows} shows screenshots, and "
                                    "env_server.sim.screenshot is none: set it to png (or jpeg)")
    check_cross_policy(cfg)
    check_workflows(cfg)
    check_group_signal(cfg)
    check_ports(cfg)
    return cfg


def check_ports(cfg: RunConfig) -> None:
    """Two listeners of a run on one port: the second to start failed to bind at every restart. (With
    ``local.port_base`` a local run numbers them itself.)"""
    if cfg.local.port_base:
        return
    seen: dict[int, str] = {}
    for key in PORT_KEYS:
        port = port_of(cfg, key)
        if port in seen:
            raise configlib.ConfigError(f"{seen[port]} and {key} are both {port}: each listener needs its own port")
        seen[port] = key


def check_group_signal(cfg: RunConfig) -> None:
    """Episode rewards rank rollouts within a group: with one rollout a group, a group-relative estimator scores
    every rollout 0, and the zero-variance rules (the learner's ``drop_zero_variance``, the broker's dynamic
    sampling) drop every group, so a run of empty steps "finished" having trained nothing."""
    adv, broker = cfg.learner.advantage, cfg.broker
    if broker.group_size >= 2 or adv.level != "trajectory":
        return
    why = [f"learner.advantage.name={adv.name} compares rollouts within a group"] if adv.name in ("group", "rloo") \
        else []
    why += ["learner.advantage.drop_zero_variance drops such groups"] if adv.drop_zero_variance else []
    why += ["broker.dynamic_sampling drops such groups"] if broker.dynamic_sampling else []
    if why:
        raise configlib.ConfigError(f"broker.group_size={broker.group_size}: a group of one rollout has no reward "
                                    f"to compare with, and {'; '.join(why)}: nothing would train. Set "
                                    "broker.group_size >= 2 (or an estimator that needs no group, "
                                    "learner.advantage.name=batch, with drop_zero_variance=false)")


def check_workflows(cfg: RunConfig) -> None:
    """Workflow-guided exploration explores the tasks it trains on, leaves the policy a rollout of every group,
    and has its successes trained on."""
    from env_server.families import kind_of

    w = cfg.actor.workflows
    if not w.enabled:
        return
    if kind_of(w.suite) != kind_of(cfg.broker.tasks.suite):
        raise configlib.ConfigError(f"actor.workflows.suite {w.suite!r} and broker.tasks.suite "
                                    f"{cfg.broker.tasks.suite!r} name different kinds of task")
    keep = cfg.broker.group_size - cfg.broker.cross_policy_slots()
    if w.slots >= keep:
        raise configlib.ConfigError(f"actor.workflows.slots={w.slots} leaves the current policy no rollout of a "
                                    f"group of {cfg.broker.group_size} ({cfg.broker.group_size - keep} cross-policy)")
    if cfg.learner.explored_coef <= 0:
        raise configlib.ConfigError("actor.workflows explores, and learner.explored_coef is 0: its successes would "
                                    "train nothing")


def check_cross_policy(cfg: RunConfig) -> None:
    """The broker's share and the actors' cross policy come together: a share nobody can play, or an engine that
    would never play, is a mistake."""
    share, source = cfg.broker.cross_policy_share, cfg.actor.cross_policy
    if share > 0 and not source:
        raise configlib.ConfigError(f"broker.cross_policy_share={share:g} gives rollouts to a cross policy, and "
                                    "actor.cross_policy names none: set it to initial or a checkpoint directory")
    if source and share <= 0:
        raise configlib.ConfigError(f"actor.cross_policy={source!r} would never play: broker.cross_policy_share is 0")
    if source and source != "initial":
        from policy.saved import is_saved_policy

        if not is_saved_policy(source):
            raise configlib.ConfigError(f"actor.cross_policy={source!r}: no saved policy there (a checkpoint "
                                        "directory, a run's checkpoints/, or a pretrain export)")


def check_suites(cfg: RunConfig) -> None:
    """Every suite the run will draw tasks from names families its backend has, before any role starts: a
    family that does not exist used to pass, and the run then played nothing while looking busy."""
    from env_server.backend_registry import registry_for

    for key, suite in (("broker.tasks.suite", cfg.broker.tasks.suite), ("local.eval_suite", cfg.local.eval_suite),
                       ("learner.anchor.suite", cfg.learner.anchor.suite),
                       ("actor.workflows.suite", cfg.actor.workflows.suite)):
        if not suite:
            continue
        try:
            registry_for(suite, cfg.env_server.backend).parse_suite(suite, key)
        except ValueError as exc:  # the registry's message names the families it has
            raise configlib.ConfigError(str(exc)) from None


def check_import_paths(cfg: RunConfig) -> None:
    """Import what the config names by import path (a custom loss, a custom advantage estimator) now, before any
    role starts: a missing module or attribute is one error at load, not a learner that exits again and again
    after the actors have begun. (``env_server.backend`` is imported by its own check.)"""
    from common.imports import load_by_path
    from learner.advantages import ESTIMATORS
    from learner.config import BUILTIN_LOSSES

    for key, name, builtin in (("learner.loss.name", cfg.learner.loss.name, BUILTIN_LOSSES),
                               ("learner.advantage.name", cfg.learner.advantage.name, tuple(ESTIMATORS))):
        if name in builtin:
            continue
        try:
            obj = load_by_path(name)
        except ValueError as exc:
            raise configlib.ConfigError(f"{key}: {exc}") from None
        if not callable(obj):
            raise configlib.ConfigError(f"{key}: {name!r} is a {type(obj).__name__}, not a function")


def planned_run_dir(cfg: RunConfig, run_dir: str | None) -> Path | None:
    """Where the run's directory will be, before anything is made: ``--run-dir``, or ``run.run_dir`` with the
    ``run.run_id`` set; None while the id is still to be drawn (a new run's, so a new directory)."""
    template = str(run_dir) if run_dir else cfg.run.run_dir
    if "{run_id}" in template and not cfg.run.run_id:
        return None
    return Path(template.format(run_id=cfg.run.run_id))


def resolve_run_dir(cfg: RunConfig, run_dir: str | None) -> RunDir:
    """Fix run_id and run_dir (an explicit --run-dir wins) and create the directory tree."""
    if run_dir and not cfg.run.run_id:
        cfg.run.run_id = Path(run_dir).name
    if not cfg.run.run_id:
        cfg.run.run_id = new_run_id()
    cfg.run.run_dir = str(planned_run_dir(cfg, run_dir))
    return RunDir.create(cfg.run.run_dir, cfg.run.run_id)


def check_machine(cfg: RunConfig, roles: Iterable[str]) -> None:
    """What ``roles`` need from the machine they start on, beyond a config that loads: the checkpoint and tokenizer
    files (``demos`` tokenizes only: a recipe records them before it pretrains the checkpoint), the learner's and the
    engines' devices, the vllm engine's package. ConfigError naming the key: each fails the same way at every start,
    so a role exits on it at once and ``computerrl run`` checks it before starting any (``load_run_config`` does
    not: ``pretrain`` may be about to write the checkpoint)."""
    import importlib.util

    from actor.vllm_engine import NEEDS_VLLM
    from policy.device import check_device

    roles = set(roles)
    if roles & {"learner", "actor"}:
        cfg.model.check_files()
    elif "demos" in roles:
        cfg.model.check_files(checkpoint=False)
    if "learner" in roles:
        check_device("learner.device", cfg.learner.device)
    if "actor" in roles:
        check_device("actor.engine.device", cfg.actor.engine.device)
        if cfg.actor.engine.kind == "vllm" and importlib.util.find_spec("vllm") is None:
            raise configlib.ConfigError(NEEDS_VLLM)


def check_resumable(run_dir: str | Path) -> None:
    """Refuse to resume a run directory that holds no checkpoint: a mistyped directory on a requeue would otherwise
    start training from scratch without a word. The error names the directories beside it that can resume. One whose
    latest checkpoint is damaged or not there is refused too (``learner.checkpoint.resume_point``: what to do is in
    the error)."""
    from learner import checkpoint as ckpt

    root = Path(run_dir)
    if ckpt.resume_point(root / "checkpoints") is not None:  # (CheckpointDamaged is a ValueError, refused as one)
        return
    parent = root.parent if root.parent.is_dir() else None
    beside = sorted(p.name for p in parent.iterdir() if p.is_dir() and ckpt.latest(p / "checkpoints") is not None) \
        if parent is not None else []
    where = f"run directories with a checkpoint in {parent}: {', '.join(beside)}" if beside else \
        f"no run directory in {parent} has one either" if parent is not None else f"{root.parent} does not exist"
    raise ValueError(f"--resume: {root} holds no checkpoint ({root / 'checkpoints' / 'latest'} is missing); "
                     f"{where}. Leave out --resume to start a new run there.")


def check_fresh(run_dir: str | Path, continue_with: str = "--resume") -> None:
    """Refuse to start a new run in a run directory whose run has checkpoints (``--resume`` left out by mistake). The
    new learner counted versions from 0 again beside the old checkpoints, the broker handed it the old run's queued
    groups from its spill log, the metrics and evaluations of both runs went into one curve, and the checkpoint
    rotation, keeping the highest versions, deleted the new run's latest checkpoint. The Slurm script, ``computerrl
    chaos`` and ``sweep`` start afresh only where there is no checkpoint to resume from, the same test as here.
    ``continue_with``: the command the message names for continuing it."""
    root = Path(run_dir)
    pointer = root / "checkpoints" / "latest"  # written with the first checkpoint, whatever became of it since
    if pointer.exists():
        raise ValueError(f"{root} holds a run with checkpoints (the latest: {pointer.read_text().strip()}): "
                         f"continue it with {continue_with}, or give the new run another --run-dir")


FIXED_ON_RESUME = ("run.run_id", "model.path", "model.kind", "model.tokenizer", "model.tokenizer_path",
                   "model.min_pixels", "model.max_pixels")
"""keys a resumed run cannot change: its checkpoints hold that model's weights, its spill log that tokenizer's ids and
that image size's image tokens, and its peers' handshakes that run id"""

FIXED_ON_RESUME_WITHOUT_PATH = ("model.arch", "model.hidden_size", "model.num_layers", "model.num_heads",
                                "model.num_kv_heads", "model.intermediate_size", "model.vocab_size", "model.init_seed")
"""the shape of a config-built model, fixed as well where the run has one (no ``model.path``)"""

SHOWN_DIFFERENCES = 8
"""differences a resume lists by name before it counts the rest"""


def resumed_config(config: str | Path | None, overrides: Iterable[str],
                   run_dir: str | Path) -> tuple[RunConfig, list[str]]:
    """The config ``--resume`` continues a run with: the one the run was asked for (``RunDir.requested_config``; a run
    directory from before it was kept: its ``config.yaml``) with this command's ``overrides`` on top, and a note for
    each thing that says what that means. A resume used to take ``config`` as given, so every override the run had
    started with was silently lost: a run started with ``learner.total_steps=100`` and preempted at step 50
    "finished" at the recipe's 40. Values of ``config`` that differ from the run's are named and not applied (given
    as overrides they change it); an override of a key in ``FIXED_ON_RESUME`` (or, for a config-built model,
    ``FIXED_ON_RESUME_WITHOUT_PATH``) is a ConfigError naming it."""
    from launch.local import fit_to_local_run

    rd = RunDir(Path(run_dir).resolve())
    base = next((p for p in (rd.requested_config, rd.config) if p.exists()), None)
    if base is None:  # (a supervisor killed before it wrote either)
        return load_run_config(config, overrides), [f"{rd.config} is missing: the run resumes with {config} as given"]
    cfg = load_run_config(base, overrides)
    changed = configlib.differences(load_run_config(base), cfg)
    fixed = [k for k in changed if k in FIXED_ON_RESUME or (k in FIXED_ON_RESUME_WITHOUT_PATH and not cfg.model.path)]
    if fixed:
        raise configlib.ConfigError(
            "; ".join(f"{k}: the run has {changed[k][0]!r}, this resume gives {changed[k][1]!r}" for k in fixed)
            + ". A resumed run keeps its model, tokenizer and run id (its checkpoints and queued groups are theirs):"
            f" start a new run for another one, or, if only the files moved, edit {base}")
    notes = [f"this resume changes {k}: {old!r} -> {new!r}" for k, (old, new) in changed.items()]
    # A config in the run directory is the run's own (the Slurm script's): nothing to compare it with.
    if config is not None and Path(config).resolve().parent != rd.root:
        given = load_run_config(config, overrides)
        given.run.run_id, given.run.run_dir = cfg.run.run_id, cfg.run.run_dir
        if base == rd.config:  # an older run's base was fitted to its shape: so is what it is compared with
            fit_to_local_run(given)
        differ = list(configlib.differences(cfg, given).items())
        if differ:
            listed = ", ".join(f"{k} {ours!r} (run) / {theirs!r}" for k, (ours, theirs) in differ[:SHOWN_DIFFERENCES])
            more = f" and {len(differ) - SHOWN_DIFFERENCES} more" if len(differ) > SHOWN_DIFFERENCES else ""
            notes.append(f"the run resumes with its own config ({base}); {config} differs from it in {listed}{more}: "
                         "not applied (give key=value on this command to change one)")
    return cfg, notes


def config_for_checkpoint(checkpoint: str | Path) -> RunConfig:
    """The run config a checkpoint was trained with (its run's config.yaml), so eval judges a policy on the prompts
    it saw; a policy directory from ``computerrl pretrain`` records its prompt layout instead."""
    import json

    from actor.prompt import PromptConfig
    from policy.saved import resolve_checkpoint

    ck = resolve_checkpoint(checkpoint)
    run_cfg_path = ck.parent.parent / "config.yaml"
    config = load_run_config(run_cfg_path if run_cfg_path.exists() else None, check_imports=False)
    state = json.loads((ck / "state.json").read_text()) if (ck / "state.json").exists() else {}
    if not run_cfg_path.exists() and "prompt" in state:
        config.actor.prompt = PromptConfig(**state["prompt"])
    return config
