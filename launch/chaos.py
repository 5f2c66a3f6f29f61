"""``computerrl chaos``: a real ``computerrl run`` while a seeded schedule of faults hits its roles, then the audit.

Faults, each at a learner step, on a role (broker, env_server, an actor, the learner):

- ``SIGKILL`` / ``SIGTERM``: the process dies (or stops cleanly); the supervisor restarts it (the learner with
  ``--resume``); if the run gives up anyway, it is continued with ``--resume``, as an operator would;
- ``partition`` (``--partitions``): the role's link goes down for ``seconds`` and comes back. Every role then runs
  in a network namespace of its own (``launch/netns.py``), so its TCP connections stay open and nothing is refused,
  as when a switch port or a node's network fails;
- ``hang``: the role is stopped (SIGSTOP) for ``seconds``, then continued — a process stalled in the kernel or
  swapped out: its sockets stay open and unanswered;
- ``stop`` (``--stops``): the role is stopped and never continued — a deadlock, a process hung for good. It never
  exits, so the supervisor must find it hung by its pulse (``local.hang_timeout_s``) and restart it, as after a kill.

A partitioned or hung role must come back by itself: it is the same process after the fault (``restarted`` says
otherwise). After the last step, the run is resumed once more for a few steps (groups queued at the end get
trained), then ``launch.audit.reconcile`` must find every acked group trained once, dropped with a reason, or
queued.

Recovery of a fault: seconds from the fault's end (the signal; the heal; the SIGCONT; a stop's SIGSTOP) until the
learner writes its next step record (training flows again), and, for a kill or a stop, until a new process of the role
runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.exitcodes import EXIT_RESUMABLE

ROLES = ("broker", "env_server", "actor", "learner")
KILLS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}


@dataclass
class Fault:
    step: int
    """learner step after which the fault starts"""
    role: str
    kind: str
    """SIGKILL, SIGTERM, partition, hang or stop"""
    seconds: float = 0.0
    """how long a partition or hang lasts"""
    every: int = 0
    """> 0: start only right after a learner step record whose step is a multiple of this (a learner fault at a
    weight round; at a checkpoint step, at its commit too)"""
    at_step: int = 0
    """the learner step it started at"""
    started_at: float = 0.0
    ended_at: float = 0.0
    pid: int = 0
    rank: str = "0"
    metrics_pos: int = 0
    role_back_s: float | None = None
    """a kill or a stop: seconds until a new process of the role runs"""
    training_back_s: float | None = None
    """seconds from the fault's end until the learner's next step record"""
    restarted: bool | None = None
    """a partition or hang: whether the role had to be restarted (it should not)"""

    @property
    def signal(self) -> int:
        return KILLS.get(self.kind, 0)

    @property
    def replaces_process(self) -> bool:
        """Whether the role can only come back as a new process (a kill; a stop, which the supervisor must notice)."""
        return bool(self.signal) or self.kind == "stop"

    @property
    def label(self) -> str:
        return f"{self.kind} {self.seconds:g} s" if self.seconds else self.kind


@dataclass
class ChaosResult:
    faults: list[Fault] = field(default_factory=list)
    resumes: int = 0
    wall_s: float = 0.0
    audit: dict = field(default_factory=dict)


def schedule(seed: int, steps: int, kills: int, sigterm_share: float = 0.25) -> list[Fault]:
    """``kills`` kills at random steps in 1 .. steps-2. Every role gets a SIGKILL before any role is hit
    twice; later hits are SIGTERM with probability ``sigterm_share``."""
    rng = random.Random(seed)
    roles: list[str] = []
    while len(roles) < kills:
        roles += rng.sample(ROLES, len(ROLES))
    sigs = [signal.SIGKILL if i < len(ROLES) or rng.random() >= sigterm_share else signal.SIGTERM
            for i in range(kills)]
    plan = list(zip(roles[:kills], sigs))
    rng.shuffle(plan)
    at = sorted(rng.randint(1, max(1, steps - 2)) for _ in range(kills))
    return [Fault(s, r, signal.Signals(sig).name) for s, (r, sig) in zip(at, plan)]


def stop_schedule(seed: int, steps: int, stops: int) -> list[Fault]:
    """``stops`` roles stopped for good at random steps in 1 .. steps-2, every role once before any twice."""
    rng = random.Random(seed + 1)  # not the kills' own draws
    roles: list[str] = []
    while len(roles) < stops:
        roles += rng.sample(ROLES, len(ROLES))
    at = sorted(rng.randint(1, max(1, steps - 2)) for _ in range(stops))
    return [Fault(s, r, "stop") for s, r in zip(at, roles[:stops])]


def network_schedule(seed: int, steps: int, spans: tuple[float, ...], roles: tuple[str, ...] = ROLES,
                     kinds: tuple[str, ...] = ("partition", "hang"), checkpoint_every: int = 1) -> list[Fault]:
    """Every role partitioned and hung once for each of ``spans`` seconds, in a seeded order spread over steps
    1 .. steps-2, one fault at a time (a fault starts once the previous one has ended). The learner's faults start
    right after a step record, when its weight round goes out; its partitions after a checkpoint step's, when its
    commit goes out too."""
    rng = random.Random(seed)
    plan = [(r, k, s) for r in roles for k in kinds for s in spans]
    rng.shuffle(plan)
    at = sorted(rng.randint(1, max(1, steps - 2)) for _ in plan)
    return [Fault(st, r, k, s, every=(checkpoint_every if k == "partition" else 1) if r == "learner" else 0)
            for st, (r, k, s) in zip(at, plan)]


def role_pids(run_dir: Path, role: str, rank: str | None = None) -> list[int]:
    """Processes of ``role`` in this run (their command line: ``launch.cli <role> ... --run-dir <run_dir>``),
    of one ``--rank`` if given. Under Slurm the ``srun`` that started a role names it too; it is not the role."""
    name = role.replace("_", "-")
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == "srun":
            continue
        if "launch.cli" in argv and name in argv[argv.index("launch.cli"):] and str(run_dir) in argv:
            if rank is None or _rank(argv) == rank:
                out.append(int(proc.name))
    return out


def _rank(argv: list[str]) -> str:
    return argv[argv.index("--rank") + 1] if "--rank" in argv[:-1] else "0"


def _learner_steps(path: Path) -> list[tuple[float, int]]:
    """(file position after the record, step) of every learner metrics record so far."""
    out = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    pos = 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "step" in rec:
            out.append((pos, int(rec["step"])))
    return out


def run_chaos(config: str, run_dir: Path, steps: int, faults: list[Fault], overrides: list[str],
              resume_steps: int = 2, timeout_s: float = 1800.0, out: Any = None, fabric: Any = None) -> ChaosResult:
    """Run ``config`` for ``steps`` learner steps under ``faults`` (in step order, one at a time), then resume it
    for ``resume_steps`` more and reconcile the audit. With ``fabric`` (``launch/netns.py``, members named by
    role label plus ``supervisor``) every role runs in its own network namespace: partitions need it.

    Faults go one at a time and a partition or hang lasts its seconds however fast the learner steps, so a run of
    exactly ``steps`` could end before the last faults had their turn (a faster learner made a CI run end one fault
    short). The run is therefore started for up to twice ``steps`` and stopped as an operator stops one (SIGINT: the
    learner checkpoints) once it has made ``steps`` steps and every fault has happened and training has come back
    after it; the final resume continues from where it stopped."""
    out = out or sys.stderr  # progress; the result is the caller's to print
    run_dir = Path(run_dir).resolve()
    metrics = run_dir / "metrics" / "learner.jsonl"
    result = ChaosResult(faults=faults)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    if any(f.kind == "partition" for f in faults) and fabric is None:
        raise ValueError("partitions need the roles in network namespaces of their own (--partitions)")
    prefix: list[str] = []
    if fabric is not None:
        fabric_file = run_dir.parent / f"{run_dir.name}.fabric.json"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        fabric.save(fabric_file)
        overrides = [*overrides, f"local.netns={fabric_file}"]
        prefix = fabric.exec_prefix("supervisor")
    base = [*prefix, sys.executable, "-m", "launch.cli", "run", config, *overrides, "--run-dir", str(run_dir)]

    def start(total: int, resume: bool) -> subprocess.Popen:
        # Killed before its first checkpoint, the run starts again (`run --resume` refuses a directory without one).
        resume = resume and (run_dir / "checkpoints" / "latest").exists()
        args = [*base, f"learner.total_steps={total}", *(["--resume"] if resume else [])]
        log = open(run_dir.parent / f"{run_dir.name}.supervisor.log", "a")
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def say(text: str) -> None:
        out.write(f"[chaos] {text}\n")
        out.flush()

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cap = 2 * steps  # faults still pending there never happen (reported with no pid)
    sup = start(cap, resume=False)
    pending = list(faults)
    seen = 0  # the newest learner step looked at
    active: Fault | None = None  # a partition or hang in progress
    watching: list[Fault] = []
    stopping = False  # asked the run to stop: every fault had its turn
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos run not finished within {timeout_s:.0f} s")
            records = _learner_steps(metrics)
            latest = records[-1][1] if records else 0
            now = time.monotonic()
            if active is not None and now >= active.started_at + active.seconds:
                _end(active, fabric)
                active.ended_at = now
                active.metrics_pos = records[-1][0] if records else 0
                say(f"{active.kind} of {active.role}-{active.rank} over after {now - active.started_at:.1f} s")
                watching.append(active)
                active = None
            boundary = latest > seen  # a step record appeared since the last look
            seen = latest
            while active is None and pending and latest >= pending[0].step:
                if pending[0].every and not (boundary and latest % pending[0].every == 0):
                    break  # waits for the next boundary it may start at (the faults after it wait too)
                f = pending.pop(0)
                pids = role_pids(run_dir, f.role)
                if not pids:
                    continue  # restarting right now: this fault lands on nothing; keep the schedule moving
                f.pid = pids[0] if f.role != "actor" else random.Random(f.step).choice(pids)
                try:
                    f.rank = _rank((Path("/proc") / str(f.pid) / "cmdline").read_bytes().decode().split("\0"))
                except OSError:
                    continue  # it exited just now
                f.started_at, f.at_step = time.monotonic(), latest
                f.metrics_pos = records[-1][0] if records else 0
                _begin(f, fabric)
                say(f"step {latest}: {f.label} {f.role}-{f.rank} (pid {f.pid})")
                if f.seconds:
                    active = f
                else:
                    f.ended_at = f.started_at
                    watching.append(f)
            now = time.monotonic()
            for f in list(watching):
                if (f.replaces_process and f.role_back_s is None
                        and any(p != f.pid for p in role_pids(run_dir, f.role, f.rank))):
                    f.role_back_s = round(now - f.started_at, 2)
                if f.training_back_s is None and records and records[-1][0] > f.metrics_pos:
                    f.training_back_s = round(now - f.ended_at, 2)
                if not f.replaces_process and f.restarted is None:
                    f.restarted = f.pid not in role_pids(run_dir, f.role, f.rank)
                if (f.role_back_s is not None or not f.replaces_process) and f.training_back_s is not None:
                    watching.remove(f)
            if not stopping and latest >= steps and not pending and active is None and not watching:
                say(f"step {latest}: every fault has had its turn; stopping the run (SIGINT)")
                os.kill(sup.pid, signal.SIGINT)
                stopping = True
            rc = sup.poll()
            if rc is not None and stopping:
                if rc not in (0, EXIT_RESUMABLE):
                    raise RuntimeError(f"the run exited with {rc} when asked to stop")
                break
            if rc is not None:
                if rc == 0:
                    if active is not None:  # the run finished inside a partition: the resume must not start cut off
                        _end(active, fabric)
                        active.ended_at = time.monotonic()
                        say(f"{active.kind} of {active.role}-{active.rank} ended with the run, after "
                            f"{active.ended_at - active.started_at:.1f} s")
                        active = None
                    break  # finished (a fault still pending never happened: reported with no pid)
                result.resumes += 1  # the supervisor gave up (or finished early): continue the run
                say(f"supervisor exited with {rc}; resuming the run")
                sup = start(cap, resume=True)
            time.sleep(0.2)
        # Resume where the run ended, as an operator extending it would: the queued groups get their turn.
        if resume_steps > 0:
            records = _learner_steps(metrics)
            sup = start((records[-1][1] if records else 0) + resume_steps, resume=True)
            try:
                sup.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the final --resume not finished within {timeout_s:.0f} s of the run") from None
            if sup.returncode != 0:
                raise RuntimeError(f"the final --resume exited with {sup.returncode}")
    finally:
        if active is not None:  # never leave a role stopped or cut off
            _end(active, fabric)
        for f in faults:  # nor one stopped for good that no supervisor ended (local.hang_timeout_s=0)
            if f.kind == "stop" and f.pid in role_pids(run_dir, f.role):
                os.kill(f.pid, signal.SIGKILL)
        if sup.poll() is None:  # the run's supervisor, or the final --resume's: never left behind
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(60)
    result.wall_s = round(time.monotonic() - t0, 1)
    from launch.audit import reconcile

    result.audit = reconcile(run_dir).as_dict()
    return result


def _begin(f: Fault, fabric: Any) -> None:
    if f.signal:
        os.kill(f.pid, f.signal)
    elif f.kind in ("hang", "stop"):
        os.kill(f.pid, signal.SIGSTOP)
    else:
        fabric.partition(f"{f.role}-{f.rank}")


def _end(f: Fault, fabric: Any) -> None:
    if f.kind == "hang":
        try:
            os.kill(f.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    elif f.kind == "partition":
        fabric.heal(f"{f.role}-{f.rank}")


def summary(result: ChaosResult) -> dict:
    by_fault: dict[str, list[float]] = {}
    for f in result.faults:
        if f.training_back_s is not None:
            by_fault.setdefault(f"{f.role} {f.label}", []).append(f.training_back_s)
    return {
        "faults": [{"step": f.at_step or f.step, "role": f.role, "rank": f.rank, "fault": f.label,
                   "signal": f.kind if f.signal else None, "pid": f.pid, "role_back_s": f.role_back_s,
                   "training_back_s": f.training_back_s, "restarted": f.restarted} for f in result.faults],
        "recovery_s_by_fault": {r: {"median": round(statistics.median(v), 2), "max": max(v), "n": len(v)}
                               for r, v in sorted(by_fault.items())},
        "supervisor_resumes": result.resumes, "wall_s": result.wall_s, "audit": result.audit,
    }
