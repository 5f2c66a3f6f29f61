"""The whole-run config: a composition of the per-component configs each package owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from actor.config import ActorConfig
from broker.config import BrokerConfig
from common import config as configlib
from common.metric_sinks import MetricsConfig
from common.model import ModelConfig
from common.net import NetConfig
from common.weightsync import WeightSyncConfig
from env_server.config import EnvServerConfig
from launch.local import LocalConfig
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


def load_run_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    cfg = configlib.load(RunConfig, path, overrides)
    # A relative model directory means: from here, or else next to the config file (configs/local.yaml
    # names configs/base-policy as "base-policy"). Made absolute, so every role and a run's saved
    # config.yaml find the same files from any working directory.
    for attr in ("path", "tokenizer_path"):
        value = getattr(cfg.model, attr)
        if value and not Path(value).is_absolute():
            here, beside = Path(value), (Path(path).parent / value if path else None)
            found = here if here.exists() else beside if beside is not None and beside.exists() else None
            if found is not None:  # not there at all: left as written (pretrain may be about to make it)
                setattr(cfg.model, attr, str(found.resolve()))
    from env_server.backends import task_kind

    suite, kind = cfg.broker.tasks.suite, task_kind(cfg.env_server.backend)
    if suite.split(":")[0] != kind:
        raise configlib.ConfigError(f"broker.tasks.suite {suite!r} names {suite.split(':')[0]!r} tasks, and "
                                    f"env_server.backend {cfg.env_server.backend!r} runs {kind!r} tasks")
    shows = cfg.actor.prompt.observation
    if shows != "tree" and cfg.env_server.backend == "sim" and cfg.env_server.sim.screenshot == "none":
        raise configlib.ConfigError(f"actor.prompt.observation {shows} shows screenshots, and "
                                    "env_server.sim.screenshot is none: set it to png (or jpeg)")
    return cfg


def resolve_run_dir(cfg: RunConfig, run_dir: str | None) -> RunDir:
    """Fix run_id and run_dir (an explicit --run-dir wins) and create the directory tree."""
    if run_dir:
        cfg.run.run_dir = str(run_dir)
        if not cfg.run.run_id:
            cfg.run.run_id = Path(run_dir).name
    if not cfg.run.run_id:
        cfg.run.run_id = new_run_id()
    cfg.run.run_dir = cfg.run.run_dir.format(run_id=cfg.run.run_id)
    return RunDir.create(cfg.run.run_dir)


def config_for_checkpoint(checkpoint: str | Path) -> RunConfig:
    """The run config a checkpoint was trained with (its run's config.yaml), so eval judges a policy on the prompts
    it saw; a policy directory from ``computerrl pretrain`` records its prompt layout instead."""
    import json

    from actor.prompt import PromptConfig
    from launch.evaluate import resolve_checkpoint

    ck = resolve_checkpoint(checkpoint)
    run_cfg_path = ck.parent.parent / "config.yaml"
    config = load_run_config(run_cfg_path if run_cfg_path.exists() else None)
    state = json.loads((ck / "state.json").read_text()) if (ck / "state.json").exists() else {}
    if not run_cfg_path.exists() and "prompt" in state:
        config.actor.prompt = PromptConfig(**state["prompt"])
    return config
