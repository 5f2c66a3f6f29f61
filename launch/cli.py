"""The ``computerrl`` command: one click group; each role is its own subcommand and process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import yaml

from common import config as configlib
from common import log as L
from launch.config import RunConfig, check_resumable, load_run_config, resolve_run_dir

CONFIG_HELP = "YAML run config (configs/*.yaml); defaults are used for anything it leaves out"


def _load(config: str | None, overrides: tuple[str, ...]) -> RunConfig:
    try:
        return load_run_config(config, overrides)
    except configlib.ConfigError as exc:
        raise click.UsageError(str(exc)) from None


@click.group()
@click.version_option(package_name="computerrl")
def main() -> None:
    """computerrl: asynchronous actor-learner RL for computer-use agents."""


def role_options(fn):
    """--config, --run-dir and the dotted overrides every role command takes."""
    fn = click.argument("overrides", nargs=-1)(fn)
    fn = click.option("--run-dir", type=click.Path(file_okay=False),
                      help="run directory shared by every role of the run")(fn)
    return click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)(fn)


def _start_role(role: str, config: str | None, run_dir: str | None, overrides: tuple[str, ...], rank: int = 0):
    """Resolve the config and run directory, record what this role runs with, set up its logs."""
    cfg = _load(config, overrides)
    rd = resolve_run_dir(cfg, run_dir)
    configlib.dump(cfg, rd.root / f"config.{role}-{rank}.yaml")
    return cfg, rd, L.setup(role, cfg.run.run_id, rank, rd.logs, cfg.run.log_level)


@main.command()
@role_options
def broker(config: str | None, run_dir: str | None, overrides: tuple[str, ...]) -> None:
    """Run the trajectory broker (OVERRIDES: dotted key=value, e.g. broker.eta=4)."""
    from broker.server import Broker
    from common.exitcodes import EXIT_RESUMABLE

    cfg, rd, log = _start_role("broker", config, run_dir, overrides)
    if not Broker(cfg.broker, cfg.net, rd, log, seed=cfg.run.seed).run():
        sys.exit(EXIT_RESUMABLE)


@main.command("env-server")
@role_options
@click.option("--rank", default=0, show_default=True, help="index of this env_server among the run's nodes")
def env_server(config: str | None, run_dir: str | None, rank: int, overrides: tuple[str, ...]) -> None:
    """Run a session server owning a pool of desktops (e.g. env_server.pool_size=32)."""
    from env_server.server import EnvServer

    cfg, rd, log = _start_role("env_server", config, run_dir, overrides, rank)
    EnvServer(cfg.env_server, cfg.net, rd, log, rank=rank, seed=cfg.run.seed).run()


@main.command()
@role_options
@click.option("--rank", default=0, show_default=True, help="index of this actor (offsets its sampling seed)")
def actor(config: str | None, run_dir: str | None, rank: int, overrides: tuple[str, ...]) -> None:
    """Run an actor: tickets from the broker, episodes on env_servers, groups back to the broker."""
    from actor.agent import Actor
    from actor.engine_factory import actor_engine

    cfg, rd, log = _start_role("actor", config, run_dir, overrides, rank)
    engine = actor_engine(cfg, rank)
    a = Actor(cfg.actor, engine, cfg.net, cfg.weights, rd, log, rank=rank)
    try:
        a.connect()
        a.run()
    finally:
        a.close()
        # A rollout abandoned at stop may still be decoding: an engine thread inside torch while the interpreter
        # exits aborted the process ("terminate called without an active exception", exit -6, and a restart).
        engine.close()


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
    from learner.process import main as learner_main

    if ranks_from_slurm:
        from learner.distributed import ranks_from_slurm as slurm_ranks
        try:
            os.environ.update(slurm_ranks(dict(os.environ)))
        except RuntimeError as exc:
            raise click.UsageError(str(exc)) from None
    cfg, rd, log = _start_role("learner", config, run_dir, overrides, int(os.environ.get("RANK", "0")))
    sys.exit(learner_main(cfg, rd, log, resume, _anchor_demos(cfg, rd)))


def _anchor_demos(cfg: Any, rd: Any) -> list | None:
    """The oracle demonstrations ``learner.anchor`` replays, recorded into the run directory by ``computerrl
    demos`` (``computerrl run`` records them itself), or None when the anchor is off."""
    if not cfg.learner.anchor.enabled:
        return None
    from common import demofile
    try:
        return demofile.load(rd.anchor_demos, demofile.anchor_settings(cfg))
    except demofile.DemoFileError as exc:
        raise click.ClickException(f"{exc}; record them first: computerrl demos -c CONFIG --run-dir {rd.root}")


@main.command()
@role_options
def demos(config: str | None, run_dir: str | None, overrides: tuple[str, ...]) -> None:
    """Record the oracle demonstrations the learner's anchor replays into the run directory (once; kept while the
    anchor, prompt and tokenizer settings stay the same)."""
    from actor.demos import record_anchor_demos

    cfg, rd, log = _start_role("demos", config, run_dir, overrides, 0)
    if not cfg.learner.anchor.enabled:
        raise click.ClickException("learner.anchor.suite is empty: this run replays no demonstrations")
    click.echo(f"{record_anchor_demos(cfg, rd, log)} demonstrations in {rd.anchor_demos}")


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
    from launch.local import Supervisor

    cfg = _load(config, overrides)
    if resume and not run_dir:
        raise click.UsageError("--resume needs the --run-dir of the run to continue")
    if resume:
        try:
            check_resumable(run_dir)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    rd = _prepare_run(cfg, run_dir)
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
                            log_suffix=S.log_suffix(dict(os.environ)), stop_signal=S.STEP_STOP_SIGNAL)
    sys.exit(supervisor.run())


def _prepare_run(cfg: RunConfig, run_dir: str | None) -> Any:
    """The run directory of a whole run (every role on the machine, or in one Slurm job), with the config it
    runs with, fitted to that shape, saved as its config.yaml."""
    from launch.local import fit_to_local_run

    rd = resolve_run_dir(cfg, run_dir)
    for note in fit_to_local_run(cfg):
        click.echo(note)
    configlib.dump(cfg, rd.config)
    return rd


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

    cfg = _load(config, overrides)  # the slurm section is validated with the rest of the config
    root = Path(run_dir or cfg.run.run_dir.format(run_id=cfg.run.run_id or "<run id>")).absolute()
    try:  # everything checked before anything is written or submitted
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
        click.echo(S.render_script(cfg, root, root / "config.yaml"))
        click.echo("# the resolved config:")
        click.echo(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
        return
    rd = _prepare_run(cfg, run_dir)
    files = S.job_files(rd.root)
    files["script"].parent.mkdir(exist_ok=True)
    files["script"].write_text(S.render_script(cfg, rd.root, rd.config))
    _submit_job(rd.root, f"partition {cfg.slurm.partition or 'default'}, {cfg.slurm.nodes} node(s)")


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
def slurm_resume(run_dir: str) -> None:
    """Submit a stopped run's job again (after `cancel`, a failure, or the requeue limit): it resumes from the
    run directory's latest checkpoint and the broker's spill log."""
    from launch import slurm as S

    root = Path(run_dir).absolute()
    if not S.job_files(root)["script"].exists():
        raise click.ClickException(f"{root} has no slurm/job.sbatch: submit it with computerrl slurm submit")
    try:
        job = S.run_job_id(root)
        state = S.job_state(job).get("state", "")
    except RuntimeError:
        job, state = "", ""
    if state in S.WAITING_STATES + S.RUNNING_STATES:
        raise click.ClickException(f"job {job} of this run is still {state.lower()}: one job per run directory")
    _submit_job(root, "resubmitting the run's script")


@slurm.command("status")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def slurm_status(run_dir: str, as_json: bool) -> None:
    """The run's job (state, attempt, requeues), the learner's step and checkpoint, each role's last metrics line."""
    from launch import slurm as S

    try:
        status = S.job_status(Path(run_dir))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(status))
        return
    metrics = status.pop("metrics")
    _emit(status, False)
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


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--once", is_flag=True, help="print the view once and exit")
@click.option("--interval", default=2.0, show_default=True, help="seconds between refreshes")
def top(run_dir: str, once: bool, interval: float) -> None:
    """The live view of any run directory, from its metric records: a run on other nodes included (all it needs
    is the shared directory). A role is shown down when its records stopped coming."""
    from common.rundir import RunDir
    from launch.local import render_view, roles_from_records

    rd = RunDir(Path(run_dir).resolve())
    cfg = load_run_config(rd.config if rd.config.exists() else None)
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
    from common.metric_sinks import MetricsForwarder
    from common.rundir import RunDir

    rd = RunDir(Path(run_dir))
    overrides = (f"metrics.sinks=[{sinks}]",) if sinks else ()
    try:
        cfg = load_run_config(rd.config if rd.config.exists() else None, overrides)
        if not cfg.metrics.forwarded:
            raise ValueError("no sink to forward to: pass --sinks tensorboard[,wandb] or set metrics.sinks")
        fwd = MetricsForwarder(rd.metrics, rd.root, cfg.metrics, cfg.run.run_id or rd.root.name,
                               configlib.to_dict(cfg))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        while True:
            n = fwd.poll()
            if not follow:
                break
            if n == 0:
                time.sleep(cfg.metrics.poll_s)
    except KeyboardInterrupt:
        pass
    finally:
        fwd.close()
    click.echo(f"forwarded {fwd.forwarded} records to {', '.join(cfg.metrics.forwarded)}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def audit(run_dir: str, as_json: bool) -> None:
    """Reconcile a run's group audit trail: every acked group trained once, dropped with a reason, or still
    queued. Exits 1 if any group was lost or trained twice."""
    from launch.audit import reconcile

    result = reconcile(run_dir)
    click.echo(json.dumps(result.as_dict()) if as_json else result.table())
    if not result.ok:
        sys.exit(1)


@main.command()
@click.option("--config", "-c", default="configs/local.yaml", show_default=True, type=click.Path(exists=True))
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="a new run directory")
@click.option("--steps", default=16, show_default=True, help="learner steps of the run under fire")
@click.option("--kills", default=8, show_default=True, help="signals sent (every role is hit before any twice)")
@click.option("--seed", default=0, show_default=True, help="seed of the schedule")
@click.option("--sigterm-share", default=0.25, show_default=True, help="share of SIGTERM among the signals (rest SIGKILL)")
@click.option("--partitions", is_flag=True,
              help="every role in a network namespace of its own (root): each role partitioned and hung once per span")
@click.option("--spans", default="9,30", show_default=True,
              help="with --partitions: seconds each partition and hang lasts (comma-separated)")
@click.option("--resume-steps", default=2, show_default=True, help="steps of the final --resume after the run")
@click.option("--timeout", "timeout_s", default=1800.0, show_default=True, help="give up after this many seconds")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.argument("overrides", nargs=-1)
def chaos(config: str, run_dir: str, steps: int, kills: int, seed: int, sigterm_share: float, partitions: bool,
          spans: str, resume_steps: int, timeout_s: float, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Hit the roles of a real run with a seeded schedule of faults (kills; with --partitions also partitions and
    hangs); print recovery times and the audit (exit 1 if any acked group was lost or trained twice)."""
    from launch.chaos import network_schedule, run_chaos, schedule, summary

    plan = schedule(seed, steps, kills, sigterm_share) if kills else []
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
        actors = _load(config, overrides).local.actors
        fabric = Fabric(f"{os.getpid() % 100000}", 1, ["supervisor", "broker-0", "env_server-0", "learner-0",
                                                       *(f"actor-{i}" for i in range(actors))])
        fabric.create()
        # A TERM (a job's end, a supervisor's stop) still removes the namespaces: as an exit, finally runs.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
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


@main.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="a checkpoint directory (step-N) or a run's checkpoints/ directory (its latest)")
@click.option("--suite", default="sim:heldout", show_default=True,
              help="sim:<train|heldout|paraphrase>[:family,...]; desk:<split>[:family,...] for real xvfb desktops; "
                   "an outside backend's <kind>:<split>[:...] (its env_server.backend comes from the config)")
@click.option("--episodes", default=20, show_default=True, help="episodes per family")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False),
              help="prompt settings to use (default: the run's config.yaml)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def eval_cmd(checkpoint: str, suite: str, episodes: int, temperature: float, config: str | None,
             as_json: bool) -> None:
    """Success rate of a checkpoint on a task suite, overall and per family."""
    import dataclasses

    from launch.evaluate import evaluate, load_policy, suite_tasks

    from launch.config import config_for_checkpoint

    run_cfg = _load(config, ()) if config else config_for_checkpoint(checkpoint)
    try:
        tasks = suite_tasks(suite, episodes, run_cfg.env_server.backend)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    engine, prompt_cfg, sampling, max_steps = load_policy(checkpoint, run_cfg)
    try:
        result = evaluate(engine, tasks, prompt_cfg, dataclasses.replace(sampling, temperature=temperature),
                          max_steps, env=run_cfg.env_server)
    finally:
        engine.close()
    result.update(checkpoint=str(checkpoint), suite=suite)
    _emit(result, as_json)


@main.command()
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="checkpoint directory to write")
@click.argument("overrides", nargs=-1)
def pretrain(config: str | None, out: str, overrides: tuple[str, ...]) -> None:
    """Behaviour cloning on oracle demonstrations: a base checkpoint (point model.path at it)."""
    from launch.pretrain import pretrain as run_pretrain

    cfg = _load(config, overrides)
    log = L.setup("pretrain", "pretrain", 0, None, cfg.run.log_level)

    def progress(step: int, total: int, loss: float) -> None:
        click.echo(f"[pretrain] step {step}/{total}  loss {loss:.4f}")

    result = run_pretrain(cfg.pretrain, cfg.model, cfg.actor.prompt, Path(out), log, progress, env=cfg.env_server)
    click.echo(json.dumps(result))


@main.command("tiny-checkpoint")
@click.argument("kind", type=click.Choice(["chat", "vlm"]))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen2_vl", "qwen2_5_vl"]), default="qwen2_vl", show_default=True,
              help="the VLM's architecture")
@click.option("--hidden", default=64, show_default=True, help="language model width")
@click.option("--layers", default=2, show_default=True, help="language model layers")
@click.option("--vision-dim", default=32, show_default=True, help="vision tower width (vlm)")
@click.option("--vision-depth", default=2, show_default=True, help="vision tower blocks (vlm)")
@click.option("--max-pixels", default=28 * 28 * 64, show_default=True,
              help="the image processor's pixel cap (vlm; 28*28 pixels per image token)")
@click.option("--rope-theta", default=1_000_000.0, show_default=True,
              help="the VLM's rotary base (small models need a small one to resolve screen positions)")
@click.option("--seed", default=0, show_default=True, help="weights and tokenizer corpus seed")
def tiny_checkpoint(kind: str, out: str, arch: str, hidden: int, layers: int, vision_dim: int, vision_depth: int,
                    max_pixels: int, rope_theta: float, seed: int) -> None:
    """A randomly initialised checkpoint shaped like a pretrained instruct model (tokenizer with chat template,
    generation config; a VLM's image processor), built here with nothing downloaded: for tests, the pixel-only
    learning check, and trying a real-model setup on a laptop."""
    from launch import tiny_checkpoints as tc

    if kind == "chat":
        path = tc.chat_checkpoint(out, hidden_size=hidden, num_layers=layers, seed=seed)
    else:
        path = tc.vlm_checkpoint(out, hidden_size=hidden, num_layers=layers, vision_dim=vision_dim,
                                 vision_depth=vision_depth, max_pixels=max_pixels, seed=seed, arch=arch,
                                 rope_theta=rope_theta)
    click.echo(str(path))


@main.command("config")
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--describe", is_flag=True, help="list every key with its type, default and meaning")
@click.argument("overrides", nargs=-1)
def config_cmd(config: str | None, describe: bool, overrides: tuple[str, ...]) -> None:
    """Print the resolved config (or, with --describe, every key and what it means)."""
    import yaml

    if describe:
        for key, tp, default, doc in configlib.describe(RunConfig):
            click.echo(f"{key:<40} {tp:<10} {default!s:<16} {doc}")
        return
    click.echo(yaml.safe_dump(configlib.to_dict(_load(config, overrides)), sort_keys=False), nl=False)


@main.group()
def bench() -> None:
    """Benchmarks: each prints its figure as a ratio against a raw baseline measured in the same run."""


@bench.command("broker")
@click.option("--payload-bytes", default=1 << 20, show_default=True, help="bytes per trajectory group")
@click.option("--persist", type=click.Choice(["on", "off"]), default="off", show_default=True)
@click.option("--actors", "num_actors", default=2, show_default=True, help="K actor processes")
@click.option("--groups", default=0, help="groups per actor (0 = about 384 MiB in total)")
@click.option("--repeats", default=3, show_default=True, help="alternate raw/ours this many times, report medians")
@click.option("--screenshots", is_flag=True, help="also: bytes per VLM trajectory with and without content addressing")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_broker(payload_bytes: int, persist: str, num_actors: int, groups: int, repeats: int, screenshots: bool,
                 as_json: bool) -> None:
    """K actor processes -> broker -> one consumer, vs bare ZeroMQ through a zmq.proxy."""
    from launch.bench.broker import run_bench, screenshot_traffic

    result = run_bench(payload_bytes, persist == "on", num_actors, groups, repeats)
    if screenshots:
        result.update(screenshot_traffic())
    _emit(result, as_json)


@bench.command("env")
@click.option("--backend", default="sim", show_default=True, type=click.Choice(["sim", "xvfb", "miniwob"]))
@click.option("--sessions", default=8, show_default=True, help="N concurrent client sessions through the server")
@click.option("--desktops", default=16, show_default=True, help="xvfb, miniwob: desktops (browsers) running at once")
@click.option("--steps", default=1000, show_default=True, help="xvfb, miniwob: solver steps over all desktops")
@click.option("--clients", default=1, show_default=True, help="client processes sharing those sessions (an actor is one)")
@click.option("--seconds", default=3.0, show_default=True, help="measuring time per figure")
@click.option("--screenshot", type=click.Choice(["none", "png", "jpeg"]), default="none", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_env(backend: str, sessions: int, desktops: int, steps: int, clients: int, seconds: float, screenshot: str,
              as_json: bool) -> None:
    """sim: steps/s in-process vs through the env_server. xvfb, miniwob: step latency, resets, concurrent desktops,
    memory."""
    if backend == "xvfb":
        from launch.bench.desktop import run_bench as run_desktop_bench
        result = run_desktop_bench(desktops, steps)
    elif backend == "miniwob":
        from launch.bench.miniwob import run_bench as run_miniwob_bench
        result = run_miniwob_bench(desktops, steps)
    else:
        from launch.bench.env import run_bench
        result = run_bench(backend, sessions, clients, seconds, screenshot)
    _emit(result, as_json)


@bench.command("actor")
@click.option("--groups", default=8, show_default=True, help="task groups the actor plays")
@click.option("--group-size", default=4, show_default=True, help="episodes per group (G)")
@click.option("--max-groups", default=2, show_default=True, help="groups in flight at once")
@click.option("--max-new-tokens", default=48, show_default=True, help="tokens per turn")
@click.option("--hidden", default=64, show_default=True, help="width of the tiny model")
@click.option("--device", default="cpu", show_default=True, help="engine device: cpu | cuda | cuda:N")
@click.option("--model", "kind", default="tiny", show_default=True, type=click.Choice(["tiny", "vlm"]),
              help="tiny: byte-level text model | vlm: tiny Qwen2-VL on screenshots")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_actor(groups: int, group_size: int, max_groups: int, max_new_tokens: int, hidden: int, device: str,
                kind: str, as_json: bool) -> None:
    """A whole actor against the sim desktop vs its engine alone on the same prompts."""
    from launch.bench.actor import run_bench

    result = run_bench(groups, group_size, max_groups, max_new_tokens, hidden, device, kind)
    _emit(result, as_json)


@bench.command("engine")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--shape", default="", help="a real model's shape, not --hidden/--layers: qwen2.5-0.5b | qwen2.5-1.5b")
@click.option("--hidden", default=64, show_default=True, help="model width (without --shape)")
@click.option("--layers", default=2, show_default=True, help="transformer blocks (without --shape)")
@click.option("--batch", "batches", multiple=True, type=int, default=(32, 128), show_default=True,
              help="fixed-length workload at this batch (repeatable; none: --batch 0)")
@click.option("--prompt-len", default=512, show_default=True, help="fixed workload: prompt tokens")
@click.option("--new-tokens", default=128, show_default=True, help="fixed workload: tokens generated per prompt")
@click.option("--workload", default="broad-sim-turns", show_default=True,
              help="mixed multi-turn workload (launch/bench/workloads/NAME.json or a path; empty: none)")
@click.option("--mixed-batch", default=64, show_default=True, help="mixed workload: rows decoded at once")
@click.option("--mixed-episodes", default=256, show_default=True, help="mixed workload: episodes played")
@click.option("--sync-every", default=0, show_default=True, help="engine decode steps per host look (0: the default)")
@click.option("--no-graphs", is_flag=True, help="decode eagerly on CUDA (no captured graphs)")
@click.option("--record", default="", help="instead: record a mixed workload to this JSON file and exit")
@click.option("--record-config", default="configs/broad.yaml", show_default=True,
              help="--record: the recipe whose policy plays (its model, prompt, sampling and task suite)")
@click.option("--record-episodes", default=240, show_default=True, help="--record: episodes played")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_engine(device: str, shape: str, hidden: int, layers: int, batches: tuple, prompt_len: int, new_tokens: int,
                 workload: str, mixed_batch: int, mixed_episodes: int, sync_every: int, no_graphs: bool, record: str,
                 record_config: str, record_episodes: int, as_json: bool) -> None:
    """Our engine vs transformers' generate (static cache) on the same model, work and batch."""
    from launch.bench.engine import record_workload, run_bench

    if record:
        _emit(record_workload(record_config, record_episodes, record), as_json)
        return

    _emit(run_bench(device, shape, hidden, layers, tuple(b for b in batches if b > 0), prompt_len, new_tokens,
                    workload, mixed_batch, mixed_episodes, sync_every, not no_graphs), as_json)


@bench.command("learner")
@click.option("--hidden", default=128, show_default=True, help="model width")
@click.option("--layers", default=2, show_default=True, help="transformer blocks")
@click.option("--groups", default=4, show_default=True, help="groups per batch (B)")
@click.option("--group-size", default=8, show_default=True, help="trajectories per group (G)")
@click.option("--prompt-len", default=256, show_default=True, help="prompt tokens per sample")
@click.option("--output-len", default=32, show_default=True, help="sampled tokens per sample")
@click.option("--steps", default=5, show_default=True, help="timed steps")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--shape", default="", help="a real model's shape, not --hidden/--layers: qwen2.5-0.5b | qwen2.5-1.5b")
@click.option("--micro-batch-tokens", default=16384, show_default=True, help="padded tokens per forward/backward")
@click.option("--activation-checkpointing", is_flag=True, help="recompute layer activations in backward (both loops)")
@click.option("--peak-tflops", default=0.0, help="device peak for MFU (default: looked up for known GPUs)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_learner(hidden: int, layers: int, groups: int, group_size: int, prompt_len: int, output_len: int,
                  steps: int, device: str, shape: str, micro_batch_tokens: int, activation_checkpointing: bool,
                  peak_tflops: float, as_json: bool) -> None:
    """Learner train tokens/s vs a bare forward+backward+step of the same model and tensors (and MFU on GPUs)."""
    from launch.bench.learner import run_learner_bench

    _emit(run_learner_bench(hidden, layers, groups, group_size, prompt_len, output_len, steps, device,
                            peak_tflops, shape, micro_batch_tokens, activation_checkpointing), as_json)


@bench.command("weights")
@click.option("--params", default=10_000_000, show_default=True, help="float32 parameters to send")
@click.option("--receivers", default=2, show_default=True, help="K receiver processes")
@click.option("--repeats", default=3, show_default=True, help="timed rounds (median reported)")
@click.option("--bucket-mb", default=512.0, show_default=True, help="bucket size of our rounds")
@click.option("--device", default="cpu", show_default=True,
              help="where sender and receivers hold weights: cpu, or cuda (all on one GPU, bf16)")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "gloo", "cuda_ipc"]),
              help="weights.backend of our rounds")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_weights(params: int, receivers: int, repeats: int, bucket_mb: float, device: str, backend: str,
                  as_json: bool) -> None:
    """Seconds per weight round to K receivers vs the raw baseline moving the same bytes: a torch.distributed
    broadcast on CPU, device-to-device copies on a GPU."""
    from launch.bench.learner import run_weights_bench

    _emit(run_weights_bench(params, receivers, repeats, bucket_mb, device, backend), as_json)


@bench.command("scale")
@click.option("--actors", default=2000, show_default=True, help="N actor connections to one broker")
@click.option("--swarms", default=4, show_default=True, help="processes the actor connections are spread over")
@click.option("--env-servers", default=8, show_default=True, help="E env_server processes (0: no desktop phase)")
@click.option("--desktops", default=500, show_default=True, help="D sim desktops leased through them in all")
@click.option("--seconds", default=60.0, show_default=True, help="how long the connections are held under traffic")
@click.option("--silence", default=20, show_default=True, help="ticket-holding actors silenced on purpose")
@click.option("--storm/--no-storm", default=True, show_default=True,
              help="kill -9 and restart the broker after the hold; time until every actor serves again")
@click.option("--profile", default="", help="write the broker's cProfile statistics to this file")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_scale(actors: int, swarms: int, env_servers: int, desktops: int, seconds: float, silence: int, storm: bool,
                profile: str, as_json: bool) -> None:
    """N actor connections against one broker (vs bare ZeroMQ at that fan-in), and D desktops on E env_servers."""
    from launch.bench.scale import ScaleSetup, run_bench

    setup = ScaleSetup(actors=actors, swarms=swarms, seconds=seconds, silence=silence, storm=storm,
                       profile=str(Path(profile).resolve()) if profile else "")
    result = run_bench(setup)
    if env_servers > 0 and desktops > 0:
        from launch.bench.env import run_scale

        result.update(run_scale(env_servers, desktops, swarms, seconds))
    _emit(result, as_json)


@bench.command("async")
@click.option("--config", "-c", default="configs/local.yaml", show_default=True, type=click.Path(exists=True))
@click.option("--steps", default=10, show_default=True, help="learner steps in each run")
@click.option("--eta", "async_eta", default=2, show_default=True, help="staleness bound of the asynchronous run")
@click.option("--latency", "latency_s", default=1.0, show_default=True,
              help="mean injected env step delay (s); real desktops take 0.2-2 s a step")
@click.option("--spread", default=0.7, show_default=True, help="lognormal sigma of per-desktop speed factors")
@click.option("--max-groups", default=4, show_default=True, help="groups each actor keeps in flight (both runs)")
@click.option("--eval-episodes", default=25, show_default=True, help="held-out episodes per family after each run")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.argument("overrides", nargs=-1)
def bench_async(config: str, steps: int, async_eta: int, latency_s: float, spread: float, max_groups: int,
                eval_episodes: int, as_json: bool, overrides: tuple[str, ...]) -> None:
    """The same learner steps synchronously (eta = 0) and asynchronously, with slow uneven desktops."""
    from launch.bench.async_pipeline import AsyncBenchSetup, run_bench

    setup = AsyncBenchSetup(steps, async_eta, latency_s, spread, max_groups, eval_episodes)
    _emit(run_bench(config, setup, list(overrides)), as_json)


def _emit(result: dict, as_json: bool) -> None:
    """A benchmark's or evaluation's result: one JSON object, or one aligned line per figure."""
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>24}: {v}")


if __name__ == "__main__":
    sys.exit(main())
