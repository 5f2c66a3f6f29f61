"""``computerrl slurm``: a run as one Slurm batch job that spans nodes, survives preemption and resumes.

``submit`` renders one sbatch script from the run config's ``slurm`` section. The job's batch shell runs the
supervisor (``computerrl run --srun``) on the first node; the supervisor starts every role as its own job step,
``srun --nodes=… --ntasks=… --nodelist=<node> --kill-on-bad-exit=1``, placed by ``launch/placement.py`` (broker
and learner ranks on the first nodes, an env_server and the actors on each other node), in the same order and
with the same readiness handshake (Hello → Ready) as on one machine, and restarts a step that dies. A role that
reserves CPUs runs ``--exact --cpus-per-task=N``; one that does not shares its node's CPUs with the others
(``--overlap``), as processes on one machine do. Node addresses are Slurm's own (``scontrol show hostnames`` of
``SLURM_JOB_NODELIST``, then each node's ``NodeAddr``); CURVE keys live in the run directory, on the shared
file system.

Preemption and time limits follow Slurm's conventions:

- ``--signal=B:USR2@<grace>`` sends the batch shell USR2 ``grace`` seconds before the end; the script forwards it
  to the supervisor as SIGTERM, which stops the learner first (it checkpoints), then the other roles (the broker's
  spill log is durable), and exits 75 (resumable);
- ``--requeue`` with ``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue and its next attempt
  continues the same run directory with ``--resume``. ``<run>/slurm/requeues`` counts these requeues and caps
  them at ``max_requeues``; a run that failed (exit 1) is never requeued;
- ``computerrl slurm cancel`` marks the run cancelled, then signals the batch shell the same way: the run
  checkpoints and stops, and the job is not requeued. ``computerrl slurm resume`` submits it again.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.exitcodes import EXIT_RESUMABLE
from common.metrics.records import last_record
from common.net.config import PORT_RANGE_ENV, port_range
from common.rundir import RunDir
from launch.local import PORT_KEYS, port_of
from launch.placement import Node, Role, allocation_roles, check_shape

REPO = Path(__file__).resolve().parents[1]
# File systems that live on one node: a run directory there is invisible to the job's other nodes.
NODE_LOCAL_FS = {"ext2/ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlayfs", "zfs", "ramfs", "squashfs"}
# Job states in which the job holds (or waits for) an allocation: one job per run directory at a time.
WAITING_STATES = ("PENDING", "REQUEUED", "CONFIGURING", "SUSPENDED")
RUNNING_STATES = ("RUNNING", "COMPLETING")


@dataclass
class SrunConfig:
    """The job step one role runs in."""

    cpus: int = 0
    """CPUs reserved per task (srun --exact --cpus-per-task); 0 = share the node's CPUs (--overlap)"""
    gpus: int = 0
    """GPUs per task (srun --gpus-per-task); the job must hold them (gres)"""
    mem: str = ""
    """memory of the step (srun --mem), e.g. 32G ("" = Slurm's default)"""
    args: list[str] = field(default_factory=list)
    """extra srun options, verbatim (e.g. --cpu-bind=cores)"""

    def argv(self) -> list[str]:
        out = ["--exact", f"--cpus-per-task={self.cpus}"] if self.cpus else ["--overlap"]
        if self.gpus:
            out.append(f"--gpus-per-task={self.gpus}")
        if self.mem:
            out.append(f"--mem={self.mem}")
        return out + list(self.args)


@dataclass
class RolloutNodesConfig:
    """The rollout nodes (env_servers and actors) as their own heterogeneous job component."""

    separate: bool = False
    """give the rollout nodes their own job component (#SBATCH hetjob) with the settings below"""
    partition: str = ""
    """their partition ("" = the job's)"""
    cpus_per_task: int = 0
    """their CPUs per node (0 = the cluster's default)"""
    mem: str = ""
    """their memory per node ("" = the cluster's default)"""
    gres: str = ""
    """their GRES per node ("" = none, e.g. CPU-only nodes beside a GPU learner node)"""
    exclusive: bool = False
    """whole rollout nodes (--exclusive)"""
    sbatch_lines: list[str] = field(default_factory=list)
    """extra sbatch options of their component, verbatim"""


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
    """nodes of the allocation: the learner's first, then one rollout node per env_server"""
    learner_nodes: int = 1
    """of those, nodes for the broker and the learner's ranks (local.learner_ranks split evenly over them)"""
    exclusive: bool = False
    """whole nodes (sbatch --exclusive): every CPU, GPU and byte of memory of each node"""
    cpus_per_task: int = 0
    """CPUs per node of the allocation (sbatch --cpus-per-task with one task per node; 0 = the cluster's default)"""
    mem: str = ""
    """sbatch --mem (per node), e.g. 64G ("" = the cluster's default)"""
    gres: str = ""
    """sbatch --gres (per node), e.g. gpu:1 ("" = none)"""
    signal_grace_s: int = 300
    """seconds before the time limit at which the job is told to checkpoint and stop (--signal=B:USR2@N)"""
    requeue: bool = True
    """put the job back in the queue after a preemption or time-limit stop, to resume the run"""
    max_requeues: int = 20
    """requeues of one submission; past them the job stops and waits for `computerrl slurm resume`"""
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
    ports: str = "auto"
    """auto: ports left at their defaults move to a range the job's id picks (jobs sharing a node); config: as set"""
    claim_wait_s: float = 120.0
    """seconds a job's run and roles wait for a run directory claim held elsewhere (a dead node's NFS lock: 90 s)"""
    rollout: RolloutNodesConfig = field(default_factory=RolloutNodesConfig)
    """the rollout nodes' own job component, when they need another partition or other GRES than the learner's"""
    broker: SrunConfig = field(default_factory=SrunConfig)
    """the broker's job step"""
    env_server: SrunConfig = field(default_factory=SrunConfig)
    """each env_server's job step"""
    learner: SrunConfig = field(default_factory=SrunConfig)
    """the learner's job step (one task per rank)"""
    actor: SrunConfig = field(default_factory=SrunConfig)
    """each actor's job step"""

    def validate(self) -> None:
        if self.nodes < 1 or self.learner_nodes < 1:
            raise ValueError("slurm.nodes and slurm.learner_nodes must be >= 1")
        if self.learner_nodes > self.nodes:
            raise ValueError(f"slurm.learner_nodes {self.learner_nodes} > slurm.nodes {self.nodes}")
        if self.claim_wait_s < 0:
            raise ValueError("slurm.claim_wait_s must be >= 0")
        if self.signal_grace_s < 0 or self.signal_grace_s > 65535:
            raise ValueError("slurm.signal_grace_s must be in 0..65535 (sbatch --signal)")
        if self.cpus_per_task < 0 or self.max_requeues < 0:
            raise ValueError("slurm.cpus_per_task and slurm.max_requeues must be >= 0")
        if self.rollout.separate and self.nodes == self.learner_nodes:
            raise ValueError("slurm.rollout.separate needs rollout nodes: slurm.nodes > slurm.learner_nodes")
        for line in self.sbatch_lines + self.rollout.sbatch_lines + [a for s in self._steps() for a in s.args]:
            if "\n" in line or not line.strip().startswith("-"):
                raise ValueError(f"slurm: {line!r} is not one sbatch/srun option such as --constraint=a100")
        for step in self._steps():
            if step.cpus < 0 or step.gpus < 0:
                raise ValueError("slurm.<role>.cpus and .gpus must be >= 0")
        if self.ports not in ("auto", "config"):
            raise ValueError(f"slurm.ports must be auto or config, not {self.ports!r}")

    def _steps(self) -> list[SrunConfig]:
        return [self.broker, self.env_server, self.learner, self.actor]

    def step(self, role: str) -> SrunConfig:
        return getattr(self, role)


# ----- the run directory's Slurm files --------------------------------------------------------------------------


def job_files(run_root: Path) -> dict[str, Path]:
    """``<run>/slurm/``: the rendered script, the current job id, the requeue count, the cancel mark, and how each
    attempt ended (``ATTEMPT_FIELDS``, a line per attempt, written by the batch script)."""
    d = Path(run_root) / "slurm"
    return {"script": d / "job.sbatch", "job_id": d / "job_id", "requeues": d / "requeues",
            "cancelled": d / "cancelled", "attempts": d / "attempts"}


ATTEMPT_FIELDS = ("job", "attempt", "exit_code", "ended", "after")
"""a line of ``<run>/slurm/attempts``, space-separated. ``ended``: finished, cancelled (``computerrl slurm cancel``),
notice (the batch shell was signalled: a time limit's USR2, the end of a preemption's grace time, ``scancel
--batch``), preempted (the scheduler signalled the job steps, not the batch shell: a preemption, or a ``scancel`` of
the steps), failed (a role kept crashing or could not run with its configuration, or the supervisor could not start
the run). ``after``: requeued, not_requeued (``slurm.max_requeues``, or ``slurm.requeue`` off), requeue_refused
(``scontrol requeue`` failed: Slurm had requeued or cancelled the job itself), or - (nothing to do)."""


def _q(value: Any) -> str:
    return shlex.quote(str(value))


# ----- the batch script ------------------------------------------------------------------------------------------


STEP_STOP_SIGNAL = signal.SIGUSR2
"""how the supervisor asks a role started by ``srun`` to stop: srun forwards SIGUSR1/SIGUSR2 to its tasks as they
are, but answers SIGTERM, SIGHUP and SIGQUIT by sending SIGKILL to every task (Slurm 22.05's
``_srun_signal_mgr``) — so a SIGTERM to srun killed the learner mid-step, before it could checkpoint"""


def srun_argv(role: Role, cfg: SlurmConfig) -> list[str]:
    """The ``srun`` that starts ``role`` on its node(s), a task per process (the learner: per rank)."""
    n = len(role.nodes)
    argv = ["srun", f"--nodes={n}", f"--ntasks={role.tasks}", f"--nodelist={','.join(x.name for x in role.nodes)}",
            "--kill-on-bad-exit=1", f"--job-name={role.label}"]
    if n > 1:
        argv.append(f"--ntasks-per-node={role.tasks // n}")
    if role.nodes[0].group is not None:
        argv.append(f"--het-group={role.nodes[0].group}")
    return argv + cfg.step(role.name).argv()


STEP_GONE_TIMEOUT_S = 30.0
"""how long ``kill_step`` waits for Slurm to have a killed step gone (past it, the supervisor goes on and says so)"""


def kill_step(role: Role, environ: dict[str, str] | None = None, timeout_s: float = STEP_GONE_TIMEOUT_S) -> str:
    """SIGKILL the tasks of ``role``'s job step on whatever node they run (``scancel --signal=KILL <job>.<step>``, the
    step found by its name, the role's label) and wait until Slurm no longer lists it. Killing the step's ``srun``
    alone is not enough before a restart: Slurm then ends the step as a cancellation, TERM first and KILL only after
    the cluster's KillWait (30 s by default). A hung learner, continued by that, spent it finishing its step with its
    ports still bound while its successor started, and the successor failed on EADDRINUSE until the run gave up
    (measured on the test cluster). Returns what it did, for the supervisor's line about the kill."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "")
    if not job or not shutil.which("squeue") or not shutil.which("scancel"):
        return "no Slurm job or tools here to kill its step with (only its srun is killed)"
    # A heterogeneous job's components are jobs of their own (ids SLURM_JOB_ID_HET_GROUP_<i>), and squeue lists a
    # component's steps under its id only: the rollout nodes' steps are not the leader's (Slurm 22.05, test cluster).
    jobs = [job] + [env[k] for i in range(int(env.get("SLURM_HET_SIZE", "0") or 0))
                    if (k := f"SLURM_JOB_ID_HET_GROUP_{i}") in env and env[k] != job]

    def steps() -> list[str] | None:  # the role's step ids, None when squeue cannot say
        out = subprocess.run(["squeue", "--steps", "--noheader", "--format=%i %j", f"--jobs={','.join(jobs)}"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return None
        return [f[0] for f in (line.split() for line in out.stdout.splitlines()) if f[1:] == [role.label]]

    try:
        ids = steps()
        if not ids:
            return (f"no step named {role.label} in job {','.join(jobs)} to kill" if ids == []
                    else "squeue did not answer")
        out = subprocess.run(["scancel", "--signal=KILL", *ids], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return f"scancel --signal=KILL {' '.join(ids)} failed: {(out.stderr or out.stdout).strip()[:200]}"
        deadline = time.monotonic() + timeout_s
        while (left := steps()) and set(left) & set(ids):
            if time.monotonic() > deadline:
                return f"step {' '.join(ids)} sent SIGKILL, still listed after {timeout_s:.0f} s"
            time.sleep(0.5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"its step not killed: {exc!r}"
    return f"step {' '.join(ids)} killed (scancel --signal=KILL)"


def placement_preview(run_cfg: Any) -> list[str]:
    """The placement of ``slurm.nodes`` symbolic nodes as the script's comment shows it (checks the shape too)."""
    cfg = run_cfg.slurm
    nodes = [Node(f"<node {i}>", f"<node {i}>", int(i >= cfg.learner_nodes) if cfg.rollout.separate else None)
             for i in range(cfg.nodes)]
    roles = allocation_roles(run_cfg, nodes, [], resume=False)
    return [f"{r.label:<12} " + " ".join(srun_argv(r, run_cfg.slurm)) for r in roles]


def _node_options(partition: str, cpus_per_task: int, mem: str, gres: str, exclusive: bool) -> list[str]:
    """The sbatch options that say what each node of a job component is."""
    out = [f"--{k}={v}" for k, v in (("partition", partition), ("mem", mem), ("gres", gres)) if v]
    if cpus_per_task:
        out.append(f"--cpus-per-task={cpus_per_task}")
    return out + (["--exclusive"] if exclusive else [])


def render_script(run_cfg: Any, run_dir: Path, config_path: Path) -> str:
    """The sbatch script of a run whose resolved config is ``config_path`` in ``run_dir``."""
    cfg: SlurmConfig = run_cfg.slurm
    cfg.validate()
    python = cfg.python or sys.executable
    files = job_files(run_dir)
    first = cfg.learner_nodes if cfg.rollout.separate else cfg.nodes
    options = [f"--job-name={cfg.job_name}", f"--nodes={first}", "--ntasks-per-node=1", f"--time={cfg.time}",
               f"--output={run_dir / 'logs' / 'slurm-%j.out'}", "--open-mode=append",
               f"--signal=B:USR2@{cfg.signal_grace_s}"]
    options += ["--requeue"] if cfg.requeue else ["--no-requeue"]
    for key, value in (("account", cfg.account), ("qos", cfg.qos)):
        if value:
            options.append(f"--{key}={value}")
    options += _node_options(cfg.partition, cfg.cpus_per_task, cfg.mem, cfg.gres, cfg.exclusive)
    options += [line.strip() for line in cfg.sbatch_lines]
    if cfg.rollout.separate:
        r = cfg.rollout
        # The second component: the rollout nodes. The batch script runs on the first component's first node.
        options += ["hetjob", f"--nodes={cfg.nodes - cfg.learner_nodes}", "--ntasks-per-node=1",
                    *_node_options(r.partition or cfg.partition, r.cpus_per_task, r.mem, r.gres, r.exclusive),
                    *(line.strip() for line in r.sbatch_lines)]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), "",
             "# Rendered by `computerrl slurm submit` from the run's config (its `slurm` section).",
             "# The supervisor (`computerrl run --srun`) starts each role as a job step on its node:",
             *(f"#   {line}" for line in placement_preview(run_cfg)),
             "set -u"]
    lines += [f"module load {_q(m)}" for m in cfg.modules]
    lines += list(cfg.setup)
    lines += [f"export {k}={_q(v)}" for k, v in sorted(cfg.env.items())]
    run_cmd = f"{_q(python)} -m launch.cli run {_q(config_path)} --run-dir {_q(run_dir)} --srun"
    if cfg.requeue:
        requeue = [
            f"  n=$(cat {_q(files['requeues'])} 2>/dev/null || echo 0)",
            f"  if [ \"$n\" -ge {cfg.max_requeues} ]; then",
            f"    echo \"[computerrl] not requeued: $n requeues already (slurm.max_requeues {cfg.max_requeues});"
            f" continue with: computerrl slurm resume {run_dir}\"",
            "    after=not_requeued",
            "  else",
            f"    echo $((n + 1)) > {_q(files['requeues'])}",
            "    echo \"[computerrl] requeueing job $SLURM_JOB_ID to resume the run (requeue $((n + 1)))\"",
            "    after=requeued",
            # Slurm may have requeued the job itself (a preemption without grace time) or cancelled it (PreemptMode
            # CANCEL): its own error says which.
            "    scontrol requeue \"$SLURM_JOB_ID\" || { after=requeue_refused; echo \"[computerrl] scontrol requeue"
            f" failed (above): if the job has left the queue, continue with: computerrl slurm resume {run_dir}\"; }}",
            "  fi"]
    else:
        requeue = [f"  echo \"[computerrl] stopped; continue with: computerrl slurm resume {run_dir}\"",
                   "  after=not_requeued"]
    lines += [
        f"cd {_q(REPO)}",
        'echo "[computerrl] job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $(hostname)"',
        # A later attempt (requeued) continues the run from its checkpoints and the broker's spill log.
        f"resume=(); [ -e {_q(run_dir / 'checkpoints' / 'latest')} ] && resume=(--resume)",
        # Slurm's notice to the batch shell (USR2 before the limit, TERM at the end of a preemption's grace time,
        # `computerrl slurm cancel`): the supervisor checkpoints and stops. The
        # trap is set before the run starts, so a notice that comes at once counts too. A preemption's TERM reaches
        # the job steps first, not this shell: the supervisor then stops by itself, exiting 75 as well.
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
        # How the attempt ended (ATTEMPT_FIELDS), for `computerrl slurm status`.
        "after=-; code=$rc",
        "if [ $rc -eq 0 ]; then ended=finished; else ended=failed; fi",
        f"if [ -e {_q(files['cancelled'])} ]; then",
        "  ended=cancelled",
        f"  echo \"[computerrl] cancelled (computerrl slurm cancel); continue with: computerrl slurm resume"
        f" {run_dir}\"",
        f"  [ $rc -eq {EXIT_RESUMABLE} ] && rc=0  # stopped as asked, state saved",
        f"elif [ $rc -eq {EXIT_RESUMABLE} ]; then  # stopped on a notice, to this shell or to the job's steps",
        "  if [ $stopping -eq 1 ]; then ended=notice; else ended=preempted; fi",
        *requeue,
        "fi",
        f"echo \"$SLURM_JOB_ID $((${{SLURM_RESTART_COUNT:-0}} + 1)) $code $ended $after\" >> {_q(files['attempts'])}",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


# ----- submitting -------------------------------------------------------------------------------------------------


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found on PATH: run this on a Slurm login node (or print the script with "
                           "`computerrl slurm submit --dry-run`)")
    return path


def check_submission(run_cfg: Any, run_dir: Path) -> list[str]:
    """Everything a submission must get right before anything is written: the placement fits the nodes, the
    checkpoint and desktop image exist. Returns warnings (a run directory on a node-local file system with nodes > 1,
    a partition whose preemption grace time is short)."""
    run_cfg.slurm.validate()
    check_shape(run_cfg, run_cfg.slurm.nodes)
    run_cfg.model.check_files()  # on the login node: the nodes read the same shared file system
    es = run_cfg.env_server
    if es.backend == "apptainer" and not Path(es.desktop.image).is_file():
        raise ValueError(f"env_server.desktop.image {es.desktop.image!r} is not a file: build it from "
                         "configs/desktop.def and put it where every node reads it")
    warnings = [w for w in [preemption_warning(run_cfg)] if w]
    if run_cfg.slurm.nodes > 1:
        fs = filesystem_type(run_dir)
        if fs in NODE_LOCAL_FS:
            warnings.append(f"the run directory {run_dir} is on {fs}, a node-local file system: the job's other "
                            "nodes will not see its config, keys and checkpoints; use a shared one (NFS, Lustre, ...)")
    return warnings


def scontrol_fields(line: str) -> dict[str, str]:
    """One record of ``scontrol show ... -o`` (``Key=value`` pairs on one line) as a dict."""
    return dict(re.findall(r"(\w+)=(\S*)", line))


def preemption_warning(run_cfg: Any) -> str:
    """A warning when the job's partition preempts with a grace time shorter than the learner is given to stop
    (``local.learner_stop_timeout_s``): a preempted learner still inside its step when the grace time ends is killed
    and loses what it trained since its last checkpoint. "" when the partition does not preempt that way, or when
    ``scontrol`` cannot say (not on a login node: ``--dry-run`` elsewhere)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return ""
    argv = [scontrol, "show", "partition", "-o", *([run_cfg.slurm.partition] if run_cfg.slurm.partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:  # a controller that does not answer: nothing to say
        return ""
    parts = [scontrol_fields(line) for line in out.stdout.splitlines()] if out.returncode == 0 else []
    part = next((p for p in parts if run_cfg.slurm.partition or p.get("Default") == "YES"), None)
    if part is None or not re.search(r"CANCEL|REQUEUE", part.get("PreemptMode", "")):
        return ""
    grace, stop = int(part.get("GraceTime", "0") or 0), run_cfg.local.learner_stop_timeout_s
    if grace >= stop:
        return ""
    every = run_cfg.learner.checkpoint_every
    return (f"partition {part.get('PartitionName')} preempts jobs (PreemptMode={part['PreemptMode']}) with a grace "
            f"time of {grace} s, less than local.learner_stop_timeout_s {stop:g} s: a preempted learner that needs longer to "
            "finish its step and checkpoint is killed, and loses what it trained since its last checkpoint "
            f"(learner.checkpoint_every {every}: {'only at the end' if not every else f'every {every} steps'}); "
            "a smaller checkpoint_every bounds that loss")


def filesystem_type(path: Path) -> str:
    """``stat -f`` of the nearest existing parent of ``path`` ("" when unknown)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    out = subprocess.run(["stat", "-f", "-c", "%T", str(p)], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def submit(script: Path, run_root: Path, context: str = "") -> str:
    """``sbatch --parsable script``: the job id, also kept in ``<run>/slurm/job_id``."""
    out = subprocess.run([require_tool("sbatch"), "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch refused the job{f' ({context})' if context else ''}: "
                           f"{out.stderr.strip() or out.stdout.strip()}")
    job = out.stdout.strip().split(";")[0]
    job_files(run_root)["job_id"].write_text(job + "\n")
    return job


# ----- inside the job ---------------------------------------------------------------------------------------------


JOB_PORTS = (20000, 32767)
"""where ``slurm.ports: auto`` numbers a job's ports: below Linux's ephemeral range (32768 on), so no outgoing
connection holds one by chance (``COMPUTERRL_PORT_RANGE`` narrows it, as it does ``free_port``)"""


def job_port_base(job_id: int) -> int:
    """The first port of job ``job_id``'s range: ``len(PORT_KEYS)`` ports per job, in turn by job id, so jobs
    submitted near each other get ranges apart (2,128 of them before one repeats) and a requeued job its own again."""
    lo, hi = port_range() or JOB_PORTS
    slots = (hi - lo + 1) // len(PORT_KEYS)
    if slots < 1:
        raise ValueError(f"{PORT_RANGE_ENV}={lo}-{hi} holds fewer than the {len(PORT_KEYS)} ports a run binds")
    return lo + len(PORT_KEYS) * (job_id % slots)


def job_ports(cfg: Any, env: dict[str, str]) -> str:
    """Under ``slurm.ports: auto``, a run whose config leaves every port at its default binds the ports of its job's
    range (``local.port_base``): of two jobs on one node, both on the defaults, the one whose broker started second
    failed at once (its broker could not bind), and with ``net.curve=off`` its actors could reach the other one's
    broker. Returns the note to print, or "" where nothing changed."""
    job = env.get("SLURM_JOB_ID", "")
    if cfg.slurm.ports != "auto" or cfg.local.port_base or not job.isdigit():
        return ""
    defaults = type(cfg)()  # the run config's defaults
    if any(port_of(cfg, key) != port_of(defaults, key) for key in PORT_KEYS):
        return ""  # the config chose its ports
    cfg.local.port_base = job_port_base(int(job))
    return f"ports from {cfg.local.port_base} (slurm.ports: auto, job {job})"


def allocation_nodes(environ: dict[str, str] | None = None) -> list[Node]:
    """The job's nodes in Slurm's order (a heterogeneous job's components one after the other, each node
    marked with its component), each at its ``NodeAddr`` (the address Slurm itself reaches it at)."""
    environ = dict(os.environ if environ is None else environ)
    groups = int(environ.get("SLURM_HET_SIZE", "0") or 0)
    lists = [(g, environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", "")) for g in range(groups)] if groups else \
        [(None, environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))]
    if not all(nodelist for _, nodelist in lists):
        raise RuntimeError("--srun needs a Slurm allocation (SLURM_JOB_NODELIST is not set)")
    scontrol = require_tool("scontrol")
    nodes = []
    for group, nodelist in lists:
        names = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True).stdout.split()
        shown = subprocess.run([scontrol, "show", "node", "-o", ",".join(names)], capture_output=True,
                               text=True).stdout
        addrs = dict(re.findall(r"NodeName=(\S+).*?NodeAddr=(\S+)", shown))
        nodes += [Node(n, addrs.get(n, n), group) for n in names]
    return nodes


def check_cpus(roles: list[Role], cfg: SlurmConfig, nodes: list[Node], environ: dict[str, str]) -> None:
    """Refuse (before any step starts) roles that reserve more CPUs on a node than the job holds there: such
    steps would wait for each other forever."""
    groups = sorted({n.group for n in nodes if n.group is not None})
    counts = [c for g in groups for c in _cpus_per_node(environ, f"_HET_GROUP_{g}")] if groups else \
        _cpus_per_node(environ)
    have = dict(zip((n.name for n in nodes), counts))
    want: dict[str, int] = {}
    for r in roles:
        for node in r.nodes:
            want[node.name] = want.get(node.name, 0) + cfg.step(r.name).cpus * r.tasks // len(r.nodes)
    for node, cpus in want.items():
        if node in have and cpus > have[node]:
            raise RuntimeError(f"the roles placed on {node} reserve {cpus} CPUs (slurm.<role>.cpus) but the job holds "
                               f"{have[node]} there: lower them, or ask for more (slurm.cpus_per_task, exclusive)")


def _cpus_per_node(environ: dict[str, str], suffix: str = "") -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE ("4(x2),2"; of one heterogeneous component with ``suffix``) as one count per node."""
    counts = []
    for part in environ.get(f"SLURM_JOB_CPUS_PER_NODE{suffix}", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def attempt(environ: dict[str, str]) -> int:
    """This job's attempt (1 = first start; a requeue adds one)."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0) + 1


def log_suffix(environ: dict[str, str]) -> str:
    """What a role's stderr file name carries inside a job: ``.job<id>.attempt<n>`` (one file per role, node,
    job and attempt; a resubmitted run is a new job)."""
    return f".job{environ.get('SLURM_JOB_ID', '?')}.attempt{attempt(environ)}"


# ----- watching and stopping ----------------------------------------------------------------------------------------


def run_job_id(run_root: Path) -> str:
    f = job_files(run_root)["job_id"]
    if not f.exists():
        raise RuntimeError(f"{run_root} has no Slurm job (no slurm/job_id): was it submitted with computerrl slurm?")
    job = f.read_text(errors="replace").strip()
    if not re.fullmatch(r"\d+", job):  # what sbatch --parsable gave; anything else would reach squeue and scancel
        raise RuntimeError(f"{f} holds {job[:40]!r}, not a Slurm job id (sbatch's number): edited or damaged; write "
                           "the job's id there (squeue --me shows it)")
    return job


def job_state(job: str) -> dict[str, str]:
    """The job's state from squeue while it is queued or running, else from scontrol (recently ended jobs) or
    sacct (accounting); {} when nobody knows it."""
    out = subprocess.run([require_tool("squeue"), "-h", "-j", job, "-o", "%T|%M|%l|%R"], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        # A heterogeneous job shows a line per component; the first (the batch script's) speaks for the job.
        state, elapsed, limit, where = out.stdout.strip().splitlines()[0].split("|", 3)
        return {"state": state, "elapsed": elapsed, "time_limit": limit, "nodes_or_reason": where, "source": "squeue"}
    out = subprocess.run([require_tool("scontrol"), "show", "job", "-o", job], capture_output=True, text=True)
    if out.returncode == 0 and "JobState=" in out.stdout:
        f = scontrol_fields(out.stdout.strip().splitlines()[0])  # the first component
        return {"state": f.get("JobState", ""), "elapsed": f.get("RunTime", ""), "exit_code": f.get("ExitCode", ""),
                "source": "scontrol"}
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State,ExitCode,Elapsed"],
                             capture_output=True, text=True)
        rows = [r for r in out.stdout.splitlines() if r.strip()]
        if out.returncode == 0 and rows:
            state, code, elapsed = rows[-1].split("|")
            return {"state": state, "exit_code": code, "elapsed": elapsed, "source": "sacct"}
    return {}


def job_status(run_root: Path) -> dict[str, Any]:
    """What ``computerrl slurm status`` shows: the job, its attempt, the learner's progress, each role's last
    metrics line."""
    run_root = Path(run_root)
    files = job_files(run_root)
    job = run_job_id(run_root)
    status: dict[str, Any] = {"job": job, **job_state(job)}
    log = run_root / "logs" / f"slurm-{job}.out"
    attempts = re.findall(r"\[computerrl\] job \S+ attempt (\d+)", log.read_text(errors="replace")) \
        if log.exists() else []
    status["attempt"] = int(attempts[-1]) if attempts else 0
    status["requeues"] = int(files["requeues"].read_text().strip() or 0) if files["requeues"].exists() else 0
    status["cancelled"] = files["cancelled"].exists()
    status["attempts"] = attempts_ended(run_root)
    rd = RunDir(run_root)
    status["checkpoint"] = rd.latest_checkpoint()
    learner = last_record(rd.metrics / "learner.jsonl")
    if learner is not None:
        status["learner"] = {k: learner.get(k) for k in ("step", "version", "phase", "success_rate", "loss")}
    status["metrics"] = {p.stem: last_record(p) for p in sorted(rd.metrics.glob("*.jsonl"))}
    return status


def attempts_ended(run_root: Path) -> list[dict[str, Any]]:
    """How each attempt of the run's jobs ended (``<run>/slurm/attempts``), oldest first; a line that is not one of
    the script's (a torn write) is skipped."""
    path = job_files(run_root)["attempts"]
    rows = path.read_text(errors="replace").splitlines() if path.exists() else []
    out = []
    for row in rows:
        fields = row.split()
        if len(fields) == len(ATTEMPT_FIELDS) and fields[1].isdigit() and fields[2].lstrip("-").isdigit():
            rec = dict(zip(ATTEMPT_FIELDS, fields))
            out.append({**rec, "attempt": int(rec["attempt"]), "exit_code": int(rec["exit_code"])})
    return out


def cancel(run_root: Path, timeout_s: float) -> str:
    """Stop the run cleanly: mark it cancelled (so the job does not requeue), then give the batch shell the same
    notice a preemption does (the learner checkpoints first) and wait for the job to end; a job still waiting
    in the queue is just removed."""
    run_root = Path(run_root)
    job = run_job_id(run_root)
    job_files(run_root)["cancelled"].write_text(f"{time.time():.0f}\n")
    state = job_state(job).get("state", "")
    scancel = require_tool("scancel")
    if state in RUNNING_STATES:
        subprocess.run([scancel, "--batch", "--signal=TERM", job], check=True, capture_output=True)
        deadline = time.monotonic() + timeout_s
        while job_state(job).get("state", "") in RUNNING_STATES:
            if time.monotonic() > deadline:
                subprocess.run([scancel, job], capture_output=True)
                return f"job {job} did not stop within {timeout_s:.0f} s: cancelled outright"
            time.sleep(1)
        return f"job {job} stopped (the learner checkpointed: {RunDir(run_root).latest_checkpoint() or 'none yet'})"
    if state in WAITING_STATES:
        subprocess.run([scancel, job], check=True, capture_output=True)
        return f"job {job} was {state.lower()}: removed from the queue"
    return f"job {job} is not running ({state or 'unknown to Slurm'}): nothing to stop"

