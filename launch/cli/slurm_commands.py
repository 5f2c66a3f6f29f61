"""``computerrl slurm``: runs as Slurm batch jobs that survive preemption and time limits (``launch/slurm.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import click
import yaml

from common import claims
from common import config as configlib
from launch.cli.base import claim_in_run_dir, emit, load_config, main, prepare_run
from launch.config import check_fresh


@main.group()
def slurm() -> None:
    """Runs as Slurm batch jobs that survive preemption and time limits."""


@slurm.command("submit")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--run-dir", type=click.Path(file_okay=False), help="run directory (default: run.run_dir)")
@click.option("--dry-run", is_flag=True, help="print the sbatch script and the resolved config; submit nothing")
def slurm_submit(config: str, overrides: tuple[str, ...], run_dir: str | None, dry_run: bool) -> None:
    """Render the run's sbatch script from its `slurm` section and submit it (e.g. slurm.partition=gpu)."""
    from launch import slurm as S
    from launch.local import fit_to_local_run

    cfg = load_config(config, overrides)  # the slurm section is validated with the rest of the config
    root = Path(run_dir or cfg.run.run_dir.format(run_id=cfg.run.run_id or "<run id>")).absolute()
    if root.is_dir() and not dry_run:  # a run there may be going: say that first
        claim_in_run_dir(root, claims.RUN, 0.0)
    _refuse_a_second_job(root)
    try:  # everything checked before anything is written or submitted
        check_fresh(root, continue_with=f"computerrl slurm resume {root}")
        warnings = S.check_submission(cfg, root)
        if not dry_run:
            S.require_tool("sbatch")
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if cfg.slurm.signal_grace_s < cfg.local.learner_stop_timeout_s:
        warnings.append(f"slurm.signal_grace_s {cfg.slurm.signal_grace_s} s is shorter than "
                        f"local.learner_stop_timeout_s {cfg.local.learner_stop_timeout_s:g} s: at the time limit the "
                        "learner may be killed before it checkpoints (the run then resumes from its last checkpoint)")
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    if dry_run:
        fit_to_local_run(cfg)
        click.echo(S.render_script(cfg, root, root / "config.requested.yaml"))
        click.echo("# the resolved config:")
        click.echo(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
        return
    rd = _write_job(cfg, run_dir)
    _submit_job(rd.root, f"partition {cfg.slurm.partition or 'default'}, {cfg.slurm.nodes} node(s)")


def _refuse_a_second_job(root: Path) -> None:
    """One job per run directory. A job still in the queue holds no claim on its directory yet
    (``common/claims.py``: its processes take it when they start), so without this a second submission, or a
    resume, would queue a second job to run the same run beside the first or after it. Where Slurm cannot say
    (no job recorded, no squeue here) there is nothing to refuse."""
    from launch import slurm as S

    try:
        job = S.run_job_id(root)
        state = S.job_state(job).get("state", "")
    except RuntimeError:
        return
    if state in S.WAITING_STATES + S.RUNNING_STATES:
        raise click.ClickException(f"job {job} of this run is still {state.lower()}: one job per run directory "
                                   f"(computerrl slurm status {root}; cancel it with computerrl slurm cancel {root})")


def _write_job(cfg, run_dir: str | Path | None):
    """The run directory with the run's config and its sbatch script. The script runs the config as asked for
    (``RunDir.requested_config``): each attempt fits it to the job it runs in, and a resume changes what was asked."""
    from launch import slurm as S

    rd = prepare_run(cfg, None if run_dir is None else str(run_dir))
    files = S.job_files(rd.root)
    files["script"].parent.mkdir(exist_ok=True)
    files["script"].write_text(S.render_script(cfg, rd.root, rd.requested_config))
    return rd


def _submit_job(root: Path, context: str) -> None:
    """Submit the run's rendered script as a new job: its requeue count starts over, no cancel mark."""
    from launch import slurm as S

    files = S.job_files(root)
    files["cancelled"].unlink(missing_ok=True)
    files["requeues"].write_text("0\n")
    try:
        job = S.submit(files["script"], root, context)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"submitted job {job}; run directory {root} (log: {root / 'logs'}/slurm-{job}.out)")


@slurm.command("resume")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("overrides", nargs=-1)
def slurm_resume(run_dir: str, overrides: tuple[str, ...]) -> None:
    """Submit a stopped run's job again (after `cancel`, a failure, or the requeue limit): it resumes from the
    run directory's latest checkpoint and the broker's spill log. Overrides change the run from there on (e.g.
    learner.total_steps=200 slurm.time=04:00:00); its model, tokenizer and run id stay."""
    from launch import slurm as S

    root = Path(run_dir).absolute()
    if not S.job_files(root)["script"].exists():
        raise click.ClickException(f"{root} has no slurm/job.sbatch: submit it with computerrl slurm submit")
    _refuse_a_second_job(root)
    if overrides:
        cfg = load_config(None, overrides, resume=str(root))
        try:
            for w in S.check_submission(cfg, root):
                click.echo(f"warning: {w}", err=True)
        except (RuntimeError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        _write_job(cfg, root)  # the script again: an override may change its #SBATCH lines
    _submit_job(root, "resubmitting the run's script")


@slurm.command("status")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def slurm_status(run_dir: str, as_json: bool) -> None:
    """The run's job (state, attempt, requeues, how each attempt ended), the learner's step and checkpoint, each role's
    last metrics line."""
    from launch import slurm as S

    try:
        status = S.job_status(Path(run_dir))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(status))
        return
    metrics, attempts = status.pop("metrics"), status.pop("attempts")
    emit(status, False)
    for a in attempts:  # how each attempt ended: preempted, a notice, cancelled, finished, failed
        then = "" if a["after"] == "-" else f", then {a['after'].replace('_', ' ')}"
        click.echo(f"{'attempt ' + str(a['attempt']):>24}: job {a['job']}, {a['ended']} (exit {a['exit_code']}){then}")
    for name, record in metrics.items():
        click.echo(f"{name:>24}: {json.dumps(record)[:300]}")


@slurm.command("cancel")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--timeout", "timeout_s", default=600.0, show_default=True,
              help="seconds to wait for the checkpoint and clean stop before cancelling outright")
def slurm_cancel(run_dir: str, timeout_s: float) -> None:
    """Stop the run's job cleanly (the learner checkpoints first) without requeueing it; `resume` continues it."""
    from launch import slurm as S

    try:
        click.echo(S.cancel(Path(run_dir), timeout_s))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        raise click.ClickException(str(exc)) from None
