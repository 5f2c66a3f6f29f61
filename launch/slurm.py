"""``computerrl slurm submit``: a run as one Slurm batch job that survives preemption and time limits.

The job is one sbatch script rendered from the run config's ``slurm`` section. Inside the allocation it runs the
local supervisor (``computerrl run``: every role, readiness handshakes, restarts) on the job's node. Preemption and
the time limit are handled with Slurm's own conventions:

- ``--signal=B:USR2@<grace>`` sends the batch shell USR2 ``grace`` seconds before the end; the script forwards it
  to the supervisor as SIGTERM, which stops the learner first (it checkpoints), then the other roles (the broker's
  spill log is durable). The supervisor then exits 75 (resumable);
- ``--requeue`` with ``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue and its next attempt
  continues the same run directory with ``--resume`` (same run id, continuing policy versions, the broker
  reloading its unconsumed groups). ``--open-mode=append`` keeps one job log across attempts.

This first increment places every role on one node (``slurm.nodes`` must be 1); roles spread over several nodes
with ``srun`` are the next one.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.exitcodes import EXIT_RESUMABLE

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SlurmConfig:
    """The Slurm batch job of ``computerrl slurm submit``."""

    job_name: str = "computerrl"
    """sbatch --job-name"""
    partition: str = ""
    """sbatch --partition ("" = the cluster's default)"""
    account: str = ""
    """sbatch --account ("" = none)"""
    qos: str = ""
    """sbatch --qos ("" = none)"""
    time: str = "04:00:00"
    """sbatch --time: the job's limit (the run is requeued and resumed when it is reached)"""
    nodes: int = 1
    """nodes of the allocation (this version runs every role on one node)"""
    cpus_per_task: int = 0
    """sbatch --cpus-per-task (0 = the cluster's default)"""
    mem: str = ""
    """sbatch --mem, e.g. 64G ("" = the cluster's default)"""
    gres: str = ""
    """sbatch --gres, e.g. gpu:1 ("" = none)"""
    signal_grace_s: int = 300
    """seconds before the time limit at which the job is told to checkpoint and stop (--signal=B:USR2@N)"""
    requeue: bool = True
    """put the job back in the queue after a preemption or time-limit stop, to resume the run"""
    sbatch_lines: list[str] = field(default_factory=list)
    """extra '#SBATCH ...' options, verbatim (e.g. "--constraint=a100")"""
    modules: list[str] = field(default_factory=list)
    """environment modules loaded first (module load ...)"""
    setup: list[str] = field(default_factory=list)
    """shell lines run before the job starts (e.g. source a virtualenv), verbatim"""
    env: dict[str, str] = field(default_factory=dict)
    """environment variables exported for every role"""
    python: str = ""
    """the python that runs computerrl on the nodes ("" = the one submitting)"""

    def validate(self) -> None:
        if self.nodes != 1:
            raise ValueError("slurm.nodes: this version runs every role on one node (nodes: 1)")
        if self.signal_grace_s < 0 or self.signal_grace_s > 65535:
            raise ValueError("slurm.signal_grace_s must be in 0..65535 (sbatch --signal)")
        if self.cpus_per_task < 0:
            raise ValueError("slurm.cpus_per_task must be >= 0")
        for line in self.sbatch_lines:
            if "\n" in line or not line.strip().startswith("-"):
                raise ValueError(f"slurm.sbatch_lines: {line!r} is not one sbatch option such as --constraint=a100")


def _q(value: Any) -> str:
    return shlex.quote(str(value))


def render_script(cfg: SlurmConfig, run_dir: Path, config_path: Path) -> str:
    """The sbatch script of a run whose resolved config is ``config_path`` in ``run_dir``."""
    cfg.validate()
    python = cfg.python or sys.executable
    options = [f"--job-name={cfg.job_name}", f"--nodes={cfg.nodes}", "--ntasks=1", f"--time={cfg.time}",
               f"--output={run_dir / 'logs' / 'slurm-%j.out'}", "--open-mode=append",
               f"--signal=B:USR2@{cfg.signal_grace_s}"]
    options += ["--requeue"] if cfg.requeue else ["--no-requeue"]
    for key, value in (("partition", cfg.partition), ("account", cfg.account), ("qos", cfg.qos),
                       ("mem", cfg.mem), ("gres", cfg.gres)):
        if value:
            options.append(f"--{key}={value}")
    if cfg.cpus_per_task:
        options.append(f"--cpus-per-task={cfg.cpus_per_task}")
    options += [line.strip() for line in cfg.sbatch_lines]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "",
             "# Rendered by `computerrl slurm submit` from the run's config (its `slurm` section).",
             "set -u"]
    lines += [f"module load {_q(m)}" for m in cfg.modules]
    lines += list(cfg.setup)
    lines += [f"export {k}={_q(v)}" for k, v in sorted(cfg.env.items())]
    run_cmd = f"{_q(python)} -m launch.cli run {_q(config_path)} --run-dir {_q(run_dir)}"
    lines += [
        f"cd {_q(REPO)}",
        'echo "[computerrl] job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $(hostname)"',
        # A later attempt (requeued) continues the run from its checkpoints and the broker's spill log.
        f"resume=(); [ -e {_q(run_dir / 'checkpoints' / 'latest')} ] && resume=(--resume)",
        # Slurm's notice (USR2 before the limit, or a preemption's TERM): the supervisor checkpoints and stops.
        # The trap is set before the run starts, so a notice that comes at once is not lost either.
        "stopping=0; child=",
        "trap 'stopping=1; [ -n \"$child\" ] && kill -TERM $child 2>/dev/null' USR2 TERM",
        f'{run_cmd} "${{resume[@]}}" &',
        "child=$!",
        "[ $stopping -eq 1 ] && kill -TERM $child 2>/dev/null",
        # `wait` returns 128+N when a trapped signal interrupts it: wait again for the supervisor's own status.
        "while :; do",
        "  wait $child; rc=$?",
        "  [ $rc -le 128 ] && break",
        "  kill -0 $child 2>/dev/null || { wait $child; rc=$?; break; }",
        "done",
        f"if [ $rc -eq {EXIT_RESUMABLE} ] && [ $stopping -eq 1 ]; then",
        *(["  echo \"[computerrl] requeueing job $SLURM_JOB_ID to resume the run\"",
           "  scontrol requeue \"$SLURM_JOB_ID\""] if cfg.requeue else ["  echo \"[computerrl] stopped; resume with"
                                                                         " computerrl run --resume\""]),
        "fi",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def submit(script: Path) -> str:
    """``sbatch --parsable script``: the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError("sbatch not found: submit from a Slurm login node (or print the script with --dry-run)")
    out = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]
