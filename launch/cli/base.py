"""The ``computerrl`` click group and what its commands share: loading a run config with its overrides, the options
every role takes, a role's start (config, run directory, logs), a whole run's directory, and printing a result."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from typing import Any, Iterable

import click

from common import claims
from common import config as configlib
from common import log as L
from common.exitcodes import EXIT_CONFIG
from common.signals import unwind_on_term
from launch.config import RunConfig, check_machine, load_run_config, resolve_run_dir, resumed_config

CONFIG_HELP = "YAML run config (configs/*.yaml); defaults are used for anything it leaves out"


def load_config(config: str | None, overrides: tuple[str, ...], here: Iterable[str] = (),
                resume: str | None = None) -> RunConfig:
    """The run config from a file (or the defaults) and dotted overrides; a bad one is a usage error naming the key.
    ``here``: roles that start on this machine, whose needs from it are checked too (``check_machine``). ``resume``:
    the run directory a resume continues, whose own config is the base (``resumed_config``)."""
    try:
        if resume is None:
            cfg = load_run_config(config, overrides)
        else:
            cfg, notes = resumed_config(config, overrides, resume)
            for note in notes:
                click.echo(f"[computerrl] {note}")
        check_machine(cfg, here)
        return cfg
    except configlib.ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.group()
@click.version_option(package_name="computerrl")
def main() -> None:
    """computerrl: asynchronous actor-learner RL for computer-use agents."""
    unwind_on_term()


def role_options(fn):
    """--config, --run-dir and the dotted overrides every role command takes."""
    fn = click.argument("overrides", nargs=-1)(fn)
    fn = click.option("--run-dir", type=click.Path(file_okay=False),
                      help="run directory shared by every role of the run")(fn)
    return click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)(fn)


class RoleCannotStart(click.ClickException):
    """A role whose configuration it cannot run with: it exits ``EXIT_CONFIG``, which its supervisor takes as a
    reason to stop the run, not to start the role again (it would fail the same way, a minute of restarts)."""

    exit_code = EXIT_CONFIG


def start_role(role: str, config: str | None, run_dir: str | None, overrides: tuple[str, ...], rank: int = 0):
    """Resolve the config and run directory, record what this role runs with, set up its logs; ``kill -USR1`` then
    prints where every thread of the role is to its stderr (what the supervisor does before it kills a role that
    would not stop). A config the role cannot run with here exits ``EXIT_CONFIG`` (``RoleCannotStart``)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        cfg = load_config(config, overrides, here=(role,))
    except click.UsageError as exc:
        raise RoleCannotStart(exc.message) from None
    try:
        rd = resolve_run_dir(cfg, run_dir)
    except OSError as exc:
        raise RoleCannotStart(unwritable(exc, cfg.run.run_dir)) from None
    # Before it writes anything there: a second process of this role instance would overwrite the first one's
    # record and logs. It waits a little: a restart may come as the last incarnation is still going.
    wait_s = cfg.slurm.claim_wait_s if SLURM_JOB_ENV in os.environ else ROLE_CLAIM_WAIT_S
    held = claim_in_run_dir(rd.root, f"{role}-{rank}", wait_s)
    try:
        configlib.dump(cfg, rd.root / f"config.{role}-{rank}.yaml")
        unrecorded = None
    except OSError as exc:  # a full disk: the record of what it runs with is not worth not running
        unrecorded = exc
    log = L.setup(role, cfg.run.run_id, rank, rd.logs, cfg.run.log_level)
    if unrecorded is not None:
        log.warning("config_not_recorded", path=str(rd.root / f"config.{role}-{rank}.yaml"), error=repr(unrecorded))
    if not held.enforced:
        log.warning("claim_unenforced", claim=held.name, why=held.why)
    return cfg, rd, log


ROLE_CLAIM_WAIT_S = 10.0
"""how long a role started outside Slurm waits for its instance's claim (``common/claims.py``) to be given back"""

SLURM_JOB_ENV = "SLURM_JOB_ID"
"""set in a Slurm job: there a claim may wait ``slurm.claim_wait_s`` for a dead node's lock to lapse"""


def claim_in_run_dir(root: Any, name: str, wait_s: float) -> Any:
    """Claim ``name`` in the run directory ``root``, or fail as a command does (exit 1: a supervisor restarts a role that
    failed, and a claim may be free by then, unlike a configuration error)."""
    try:
        return claims.claim(root, name, wait_s=wait_s)
    except claims.ClaimHeld as exc:
        raise click.ClickException(f"{exc}. One process per {'run' if name == claims.RUN else 'role instance'} "
                                   "and run directory: stop that one first, or give this one another --run-dir"
                                   + ("" if name == claims.RUN else " or --rank")) from None


def unwritable(exc: OSError, root: Any) -> str:
    """What to say when a run directory cannot be made or written, naming the path that refused."""
    return (f"the run directory {root} cannot be written: {exc.strerror or exc} ({exc.filename or root}); "
            "give the run a --run-dir this user can write")


def prepare_run(cfg: RunConfig, run_dir: str | None, job_env: dict[str, str] | None = None) -> Any:
    """The run directory of a whole run (every role on the machine, or in one Slurm job), with the config it
    runs with, fitted to that shape, saved as its config.yaml. ``job_env``: the environment of the Slurm job it
    runs in, whose id picks its ports under ``slurm.ports: auto`` (``launch.slurm.job_ports``). That fitting comes
    after the requested config is saved, so a ``resume`` under a new job id takes its own job's range rather than
    the first job's (a range chosen when the first job's neighbours were the ones running)."""
    from launch.local import fit_to_local_run

    try:
        rd = resolve_run_dir(cfg, run_dir)
        held = claim_in_run_dir(rd.root, claims.RUN, cfg.slurm.claim_wait_s if job_env is not None else 0.0)
        if not held.enforced:
            click.echo(f"[computerrl] warning: {held.why}", err=True)
        configlib.dump(cfg, rd.requested_config)
    except OSError as exc:  # a folder one may only read (another user's, a read-only mount), a full disk
        raise click.ClickException(unwritable(exc, cfg.run.run_dir)) from None
    if job_env is not None:
        from launch.slurm import job_ports

        note = job_ports(cfg, job_env)
        if note:
            click.echo(f"[computerrl] {note}")
    for note in fit_to_local_run(cfg):
        click.echo(note)
    configlib.dump(cfg, rd.config)
    return rd


def emit(result: dict, as_json: bool) -> None:
    """A benchmark's or evaluation's result: one JSON object, or one aligned line per figure."""
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>24}: {v}")
