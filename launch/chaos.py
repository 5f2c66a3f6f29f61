"""``computerrl chaos``: a real ``computerrl run`` while a seeded schedule kills its roles, then the audit.

The schedule picks, for each kill, a learner step at which it happens, a role (broker, env_server, an actor,
the learner) and a signal (mostly SIGKILL, some SIGTERM). The supervisor restarts what dies (the learner
with ``--resume``); if the run gives up anyway, it is continued with ``--resume``, as an operator would.
After the last step, the run is resumed once more for a few steps (groups queued at the end get trained),
then ``common.audit.reconcile`` must find every acked group trained once, dropped with a reason, or queued.

Recovery time of a kill: seconds from the signal until the learner writes its next step record (training
flows again), and until the killed role runs again (a new process of it is up).
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

ROLES = ("broker", "env_server", "actor", "learner")


@dataclass
class Kill:
    step: int
    """learner step after which the signal is sent"""
    role: str
    signal: int
    killed_at: float = 0.0
    pid: int = 0
    rank: str = "0"
    metrics_pos: int = 0
    role_back_s: float | None = None
    training_back_s: float | None = None


@dataclass
class ChaosResult:
    kills: list[Kill] = field(default_factory=list)
    resumes: int = 0
    wall_s: float = 0.0
    audit: dict = field(default_factory=dict)


def schedule(seed: int, steps: int, kills: int, sigterm_share: float = 0.25) -> list[Kill]:
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
    return [Kill(s, r, sig) for s, (r, sig) in zip(at, plan)]


def role_pids(run_dir: Path, role: str, rank: str | None = None) -> list[int]:
    """Processes of ``role`` in this run (their command line: ``launch.cli <role> ... --run-dir <run_dir>``),
    of one ``--rank`` if given."""
    name = role.replace("_", "-")
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
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


def run_chaos(config: str, run_dir: Path, steps: int, kills: list[Kill], overrides: list[str],
              resume_steps: int = 2, timeout_s: float = 1800.0, out: Any = None) -> ChaosResult:
    out = out or sys.stderr  # progress; the result is the caller's to print
    run_dir = Path(run_dir).resolve()
    metrics = run_dir / "metrics" / "learner.jsonl"
    result = ChaosResult(kills=kills)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    base = [sys.executable, "-m", "launch.cli", "run", config, *overrides, "--run-dir", str(run_dir)]

    def start(total: int, resume: bool) -> subprocess.Popen:
        # Killed before its first checkpoint, the run starts again (`run --resume` refuses a directory without one).
        resume = resume and (run_dir / "checkpoints" / "latest").exists()
        args = [*base, f"learner.total_steps={total}", *(["--resume"] if resume else [])]
        log = open(run_dir.parent / f"{run_dir.name}.supervisor.log", "a")
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    sup = start(steps, resume=False)
    pending = list(kills)
    watching: list[Kill] = []
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos run not finished within {timeout_s:.0f} s")
            records = _learner_steps(metrics)
            latest = records[-1][1] if records else 0
            while pending and latest >= pending[0].step:
                k = pending.pop(0)
                pids = role_pids(run_dir, k.role)
                if not pids:
                    continue  # restarting right now: this kill lands on nothing; keep the schedule moving
                k.pid = pids[0] if k.role != "actor" else random.Random(k.step).choice(pids)
                try:
                    k.rank = _rank((Path("/proc") / str(k.pid) / "cmdline").read_bytes().decode().split("\0"))
                except OSError:
                    continue  # it exited just now
                k.killed_at = time.monotonic()
                k.metrics_pos = records[-1][0] if records else 0
                os.kill(k.pid, k.signal)
                out.write(f"[chaos] step {latest}: {signal.Signals(k.signal).name} {k.role} (pid {k.pid})\n")
                out.flush()
                watching.append(k)
            now = time.monotonic()
            for k in list(watching):
                if k.role_back_s is None and any(p != k.pid for p in role_pids(run_dir, k.role, k.rank)):
                    k.role_back_s = round(now - k.killed_at, 2)
                if k.training_back_s is None and records and records[-1][0] > k.metrics_pos:
                    k.training_back_s = round(now - k.killed_at, 2)
                if k.role_back_s is not None and k.training_back_s is not None:
                    watching.remove(k)
            rc = sup.poll()
            if rc is not None:
                if rc == 0:
                    break  # finished (a kill still pending never happened: reported with no pid)
                result.resumes += 1  # the supervisor gave up (or finished early): continue the run
                out.write(f"[chaos] supervisor exited with {rc}; resuming the run\n")
                sup = start(steps, resume=True)
            time.sleep(0.2)
        # Resume where the run ended, as an operator extending it would: the queued groups get their turn.
        if resume_steps > 0:
            final = start(steps + resume_steps, resume=True)
            final.wait(max(1.0, deadline - time.monotonic()))
            if final.returncode != 0:
                raise RuntimeError(f"the final --resume exited with {final.returncode}")
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(60)
    result.wall_s = round(time.monotonic() - t0, 1)
    from common.audit import reconcile

    result.audit = reconcile(run_dir).as_dict()
    return result


def summary(result: ChaosResult) -> dict:
    by_role: dict[str, list[float]] = {}
    for k in result.kills:
        if k.training_back_s is not None:
            by_role.setdefault(k.role, []).append(k.training_back_s)
    return {
        "kills": [{"step": k.step, "role": k.role, "signal": signal.Signals(k.signal).name, "pid": k.pid,
                   "role_back_s": k.role_back_s, "training_back_s": k.training_back_s} for k in result.kills],
        "recovery_s_by_role": {r: {"median": round(statistics.median(v), 2), "max": max(v), "n": len(v)}
                               for r, v in sorted(by_role.items())},
        "supervisor_resumes": result.resumes, "wall_s": result.wall_s, "audit": result.audit,
    }
