"""Commands over whole runs: ``run`` (every role on this machine, supervised), ``top``, ``sweep``, ``metrics``,
``audit`` and ``chaos``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from common import claims
from common import config as configlib
from launch.config import check_fresh, check_resumable, load_run_config, planned_run_dir
from launch.cli.base import claim_in_run_dir, load_config, main, prepare_run


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--run-dir", type=click.Path(file_okay=False), help="run directory (default: run.run_dir)")
@click.option("--resume", is_flag=True, help="continue the run in --run-dir from its latest checkpoint")
@click.option("--srun", is_flag=True,
              help="start each role as a job step of this Slurm allocation, spread over its nodes (what the batch "
                   "job of `computerrl slurm submit` runs)")
def run(config: str, overrides: tuple[str, ...], run_dir: str | None, resume: bool, srun: bool) -> None:
    """Run every role on this machine, supervised, with a live view (e.g. configs/local.yaml learner.lr=3e-4)."""
    from launch.local import Supervisor, check_ports_free

    if resume and not run_dir:
        raise click.UsageError("--resume needs the --run-dir of the run to continue")
    try:
        if resume:
            check_resumable(run_dir)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    # Locally every role starts here; under --srun on the allocation's nodes, where each role checks for itself.
    cfg = load_config(config, overrides, here=() if srun else ("learner", "actor"), resume=run_dir if resume else None)
    planned = planned_run_dir(cfg, run_dir)
    if planned is not None and planned.is_dir():  # a run there may be going: say that, not that its ports are taken
        claim_in_run_dir(planned, claims.RUN, cfg.slurm.claim_wait_s if srun else 0.0)
    try:
        if not resume and planned is not None:
            check_fresh(planned)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not srun and not cfg.local.netns:  # (a network fabric's namespaces each have ports of their own)
        try:
            check_ports_free(cfg)
        except configlib.ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    rd = prepare_run(cfg, run_dir, job_env=dict(os.environ) if srun else None)
    if not srun:
        sys.exit(Supervisor(cfg, rd.config, rd, resume).run())
    from launch import slurm as S
    from launch.placement import allocation_roles, describe

    try:
        nodes = S.allocation_nodes()
        roles = allocation_roles(cfg, nodes, ["--config", str(rd.config), "--run-dir", str(rd.root)], resume)
        S.check_cpus(roles, cfg.slurm, nodes, dict(os.environ))
    except (RuntimeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in describe(roles):
        click.echo(f"[computerrl] placement: {line}")
    supervisor = Supervisor(cfg, rd.config, rd, resume, roles=roles, launcher=lambda r: S.srun_argv(r, cfg.slurm),
                            log_suffix=S.log_suffix(dict(os.environ)), stop_signal=S.STEP_STOP_SIGNAL,
                            scheduler_steps=True, kill_step=S.kill_step)
    sys.exit(supervisor.run())


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--once", is_flag=True, help="print the view once and exit")
@click.option("--interval", default=2.0, show_default=True, help="seconds between refreshes")
def top(run_dir: str, once: bool, interval: float) -> None:
    """The live view of any run directory, from its metric records: a run on other nodes included (all it needs
    is the shared directory). A role is shown down when its records stopped coming."""
    from common.rundir import RunDir
    from launch.live_view import render_view, roles_from_records

    rd = RunDir(Path(run_dir).resolve())
    if not rd.is_run():
        raise click.UsageError(f"{run_dir}: {RunDir.NOT_A_RUN}")
    cfg = load_run_config(rd.config if rd.config.exists() else None, check_imports=False)
    tty = sys.stdout.isatty() and not once
    shown = 0
    try:
        while True:
            roles, elapsed = roles_from_records(rd, cfg)
            lines = [f"run {rd.root}", *render_view(rd, cfg, elapsed, roles)]
            if tty and shown:
                sys.stdout.write(f"\x1b[{shown}F\x1b[J")
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()
            shown = len(lines)
            if once:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--vary", multiple=True,
              help="key=a,b[,c]: one variant per value (repeat for a grid; a list value in brackets: [x,y])")
@click.option("--variant", "variants", multiple=True,
              help="'key=v key2=w': one variant of settings that go together (repeat; crossed with --vary)")
@click.option("--seeds", default=3, show_default=True,
              help="runs per variant (run.seed 0..N-1; a re-run may ask for more)")
@click.option("--first-seed", default=0, show_default=True,
              help="run.seed of each variant's first run: K..K+N-1 (split seeds between machines or sessions)")
@click.option("--parallel", default=1, show_default=True, help="runs at once")
@click.option("--out", type=click.Path(file_okay=False), help="sweep directory (default: sweeps/<config name>)")
@click.option("--eval-suite", default="", help="held-out suite of the final evaluations (default: local.eval_suite)")
@click.option("--eval-episodes", default=20, show_default=True, help="final-evaluation episodes per family")
def sweep(config: str, overrides: tuple[str, ...], vary: tuple[str, ...], variants: tuple[str, ...], seeds: int,
          first_seed: int, parallel: int, out: str | None, eval_suite: str, eval_episodes: int) -> None:
    """Every variant (--vary grid, --variant sets) x seeds as ordinary runs, each final checkpoint evaluated on
    the same held-out episodes; a table with 95 % intervals and learning curves. Run it again to continue.
    E.g. computerrl sweep configs/local.yaml --vary learner.loss.name=grpo,reinforce --seeds 3"""
    from launch.sweep import Sweep, spec_from_args

    try:
        spec = spec_from_args(config, vary, seeds, overrides, eval_suite, eval_episodes, variants, first_seed)
        runner = Sweep(spec, Path(out or Path("sweeps") / Path(config).stem), parallel, click.echo)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    rc = runner.run()
    click.echo((runner.out / "results.md").read_text())
    sys.exit(rc)


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--sinks", default="", help="comma-separated sinks (tensorboard,wandb); default: the run's own")
@click.option("--follow", is_flag=True, help="keep forwarding new records until interrupted")
def metrics(run_dir: str, sinks: str, follow: bool) -> None:
    """Forward a run's metric records to TensorBoard / W&B (what `computerrl run` does as it goes): for roles
    started by hand, or a run that had no sink selected. Records already forwarded are not sent again."""
    from common.metrics.sinks import MetricsForwarder
    from common.rundir import RunDir

    rd = RunDir(Path(run_dir))
    overrides = (f"metrics.sinks=[{sinks}]",) if sinks else ()
    try:
        cfg = load_run_config(rd.config if rd.config.exists() else None, overrides, check_imports=False)
        if not cfg.metrics.forwarded:
            raise ValueError("no sink to forward to: pass --sinks tensorboard[,wandb] or set metrics.sinks")
        fwd = MetricsForwarder(rd.metrics, rd.root, cfg.metrics, cfg.run.run_id or rd.root.name,
                               configlib.to_dict(cfg))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # a run directory one may only read: its sinks' files and the place reached go there
        raise click.ClickException(f"cannot write {exc.filename or rd.root}: {exc.strerror or exc}; forwarding writes "
                                   "TensorBoard's files and how far it got into the run directory") from None
    try:
        while True:
            n = fwd.poll()
            if not follow:
                break
            if n == 0:
                time.sleep(cfg.metrics.poll_s)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise click.ClickException(f"forwarding stopped: cannot write {exc.filename or rd.root}: "
                                   f"{exc.strerror or exc}") from None
    finally:
        fwd.close()
    click.echo(f"forwarded {fwd.forwarded} records to {', '.join(cfg.metrics.forwarded)}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def audit(run_dir: str, as_json: bool) -> None:
    """Reconcile a run's group audit trail: every acked group trained once, dropped with a reason, or still
    queued. Exits 1 if any group was lost or trained twice."""
    from common.rundir import RunDir
    from launch.audit import reconcile

    if not RunDir(Path(run_dir)).is_run():  # (a mistyped path audited as a run of nothing exited 0)
        raise click.UsageError(f"{run_dir}: {RunDir.NOT_A_RUN}: nothing to audit")
    result = reconcile(run_dir)
    click.echo(json.dumps(result.as_dict()) if as_json else result.table())
    if not result.ok:
        sys.exit(1)


@main.command()
@click.option("--config", "-c", default="configs/local.yaml", show_default=True, type=click.Path(exists=True))
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="a new run directory")
@click.option("--steps", default=16, show_default=True,
              help="learner steps of the run under fire (up to twice this while faults are pending)")
@click.option("--kills", default=8, show_default=True, help="signals sent (every role is hit before any twice)")
@click.option("--seed", default=0, show_default=True, help="seed of the schedule")
@click.option("--sigterm-share", default=0.25, show_default=True, help="share of SIGTERM among the signals (rest SIGKILL)")
@click.option("--stops", default=0, show_default=True,
              help="roles stopped for good (SIGSTOP, never continued): the supervisor must restart them "
                   "(local.hang_timeout_s)")
@click.option("--partitions", is_flag=True,
              help="every role in a network namespace of its own (root): each role partitioned and hung once per span")
@click.option("--spans", default="9,30", show_default=True,
              help="with --partitions: seconds each partition and hang lasts (comma-separated)")
@click.option("--resume-steps", default=2, show_default=True, help="steps of the final --resume after the run")
@click.option("--timeout", "timeout_s", default=1800.0, show_default=True, help="give up after this many seconds")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.argument("overrides", nargs=-1)
def chaos(config: str, run_dir: str, steps: int, kills: int, seed: int, sigterm_share: float, stops: int,
          partitions: bool, spans: str, resume_steps: int, timeout_s: float, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Hit the roles of a real run with a seeded schedule of faults (kills; stops for good; with --partitions also
    partitions and hangs); print recovery times and the audit (exit 1 if any acked group was lost or trained twice)."""
    from launch.chaos import network_schedule, run_chaos, schedule, stop_schedule, summary

    plan = schedule(seed, steps, kills, sigterm_share) if kills else []
    if stops:
        if not load_config(config, overrides).local.hang_timeout_s:
            raise click.UsageError("--stops needs local.hang_timeout_s > 0: nothing else restarts a stopped role")
        plan = sorted([*plan, *stop_schedule(seed, steps, stops)], key=lambda f: f.step)
    fabric = None
    if partitions:
        from launch.netns import Fabric, missing
        why = missing()
        if why:
            raise click.ClickException(f"--partitions: {why}")
        try:
            span_s = tuple(float(x) for x in spans.split(","))
        except ValueError:
            raise click.UsageError(f"--spans {spans!r}: seconds, comma-separated (e.g. 9,30)") from None
        plan = sorted([*plan, *network_schedule(seed, steps, span_s)], key=lambda f: f.step)
        actors = load_config(config, overrides).local.actors
        fabric = Fabric(f"{os.getpid() % 100000}", 1, ["supervisor", "broker-0", "env_server-0", "learner-0",
                                                       *(f"actor-{i}" for i in range(actors))])
        fabric.create()  # a TERM (a job's end) still removes it: main() makes TERM unwind through the finally below
    try:
        result = summary(run_chaos(config, Path(run_dir), steps, plan, list(overrides), resume_steps, timeout_s,
                                   fabric=fabric))
    finally:
        if fabric is not None:
            fabric.destroy()
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k in result["faults"]:
            click.echo(f"step {k['step']:>3}  {k['fault']:<14} {k['role']}-{k['rank']:<6}  role back {k['role_back_s']} s  "
                       f"training back {k['training_back_s']} s" + ("  RESTARTED" if k["restarted"] else ""))
        for role, r in result["recovery_s_by_fault"].items():
            click.echo(f"recovery {role:<22} median {r['median']} s  max {r['max']} s  (n={r['n']})")
        click.echo(f"supervisor resumes: {result['supervisor_resumes']}  wall: {result['wall_s']} s")
        click.echo(json.dumps(result["audit"]))
    if not result["audit"].get("ok"):
        sys.exit(1)
