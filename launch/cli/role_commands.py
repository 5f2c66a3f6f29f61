"""The per-role commands (``broker``, ``env-server``, ``actor``, ``learner``), each its own process, and ``demos``,
which records the learner's anchor demonstrations before it starts."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from common.net.client import OtherRunError
from launch.cli.base import RoleCannotStart, main, role_options, start_role


@main.command()
@role_options
def broker(config: str | None, run_dir: str | None, overrides: tuple[str, ...]) -> None:
    """Run the trajectory broker (OVERRIDES: dotted key=value, e.g. broker.eta=4)."""
    from broker.server import Broker
    from common.exitcodes import EXIT_RESUMABLE

    cfg, rd, log = start_role("broker", config, run_dir, overrides)
    if not Broker(cfg.broker, cfg.net, rd, log, seed=cfg.run.seed).run():
        sys.exit(EXIT_RESUMABLE)


@main.command("env-server")
@role_options
@click.option("--rank", default=0, show_default=True, help="index of this env_server among the run's nodes")
def env_server(config: str | None, run_dir: str | None, rank: int, overrides: tuple[str, ...]) -> None:
    """Run a session server owning a pool of desktops (e.g. env_server.pool_size=32)."""
    from env_server.server import EnvServer

    cfg, rd, log = start_role("env_server", config, run_dir, overrides, rank)
    EnvServer(cfg.env_server, cfg.net, rd, log, rank=rank, seed=cfg.run.seed).run()


@main.command()
@role_options
@click.option("--rank", default=0, show_default=True, help="index of this actor (offsets its sampling seed)")
def actor(config: str | None, run_dir: str | None, rank: int, overrides: tuple[str, ...]) -> None:
    """Run an actor: tickets from the broker, episodes on env_servers, groups back to the broker."""
    cfg, rd, log = start_role("actor", config, run_dir, overrides, rank)  # before torch: a bad config exits at once
    from actor.agent import Actor
    from actor.engine_factory import actor_engine, cross_policy_engine
    from actor.workflow_explorer import workflow_explorer

    explorer = workflow_explorer(cfg, _run_demos(cfg, rd, "workflows"), rank)
    engine = actor_engine(cfg, rank)
    cross = cross_policy_engine(cfg, rank)
    a = Actor(cfg.actor, engine, cfg.net, cfg.weights, rd, log, rank=rank, cross_engine=cross,
              explorer=explorer)
    try:
        a.connect()
        a.run()
    except OtherRunError as exc:
        raise RoleCannotStart(str(exc)) from None
    finally:
        a.close()
        # A rollout abandoned at stop may still be decoding: an engine thread inside torch while the interpreter
        # exits aborted the process ("terminate called without an active exception", exit -6, and a restart).
        for e in (engine, cross):
            if e is not None:
                e.close()


@main.command()
@role_options
@click.option("--resume", is_flag=True, help="continue from the run directory's latest checkpoint")
@click.option("--ranks-from-slurm", is_flag=True,
              help="take RANK, WORLD_SIZE, LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID "
                   "(srun, a task per rank)")
def learner(config: str | None, run_dir: str | None, resume: bool, ranks_from_slurm: bool,
            overrides: tuple[str, ...]) -> None:
    """Run the learner: batches from the broker, training steps, weights to the actors, checkpoints.

    Several ranks (FSDP2): start every rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if ranks_from_slurm:
        from learner.distributed import ranks_from_slurm as slurm_ranks
        try:
            os.environ.update(slurm_ranks(dict(os.environ)))
        except RuntimeError as exc:
            raise RoleCannotStart(str(exc)) from None
    cfg, rd, log = start_role("learner", config, run_dir, overrides, int(os.environ.get("RANK", "0")))
    from learner.checkpoint import CheckpointDamaged  # after the config: a bad one exits before torch loads
    from learner.process import main as learner_main

    try:
        code = learner_main(cfg, rd, log, resume, _run_demos(cfg, rd, "anchor"))
    except (OtherRunError, CheckpointDamaged) as exc:  # the same at every restart
        raise RoleCannotStart(str(exc)) from None
    sys.exit(code)


def _run_demos(cfg: Any, rd: Any, name: str) -> list | None:
    """The run's demonstration set ``name`` (``anchor``: the learner's; ``workflows``: the actors'), recorded into
    the run directory by ``computerrl demos`` (``computerrl run`` records them itself), or None when it is off."""
    from actor.demos import load_run_demos
    from common import demofile
    try:
        return load_run_demos(cfg, rd, name)
    except demofile.DemoFileError as exc:
        raise RoleCannotStart(f"{exc}; record them first: computerrl demos -c CONFIG --run-dir {rd.root}")


@main.command()
@role_options
def demos(config: str | None, run_dir: str | None, overrides: tuple[str, ...]) -> None:
    """Record the run's demonstrations into its directory: those the learner's anchor replays, those the actors'
    workflow explorer starts from (once; kept while their suite, prompt and tokenizer settings stay the same)."""
    from actor.demos import record_run_demos

    cfg, rd, log = start_role("demos", config, run_dir, overrides, 0)
    counts = record_run_demos(cfg, rd, log)
    if not counts:
        raise click.ClickException("learner.anchor.suite and actor.workflows.suite are empty: this run records no "
                                   "demonstrations")
    for name, n in counts.items():
        click.echo(f"{n} demonstrations ({name}) in {rd.demos(name)}")
