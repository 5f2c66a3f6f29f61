"""Exclusive claims on a run directory: one whole run (a supervisor, a job's submission) and one process per role
instance (``broker-0``, ``learner-1``, ``actor-3``) at a time.

Two writers in one run directory mix two histories without a word. Tried by hand (2026-12-03): a second ``computerrl
run --resume`` of a running run on ports of its own (``local.port_base``) started, overwrote the run's requested
config, resumed a second learner from the first one's step 10 beside it, and the two learners' checkpoints (steps
17, 20 and 30), metrics (37 learner records for 30 steps) and brokers (one spill log, two writers) went into one
directory; ``computerrl audit`` took the two learners for one that had resumed. Now the second one exits before it
writes anything, naming the process that holds the run.

A claim is ``flock(2)`` on one file of the run directory's ``claims/``, held for the life of the process: the kernel
drops it when the process dies, however it dies (``kill -9`` included), so a claim left by a dead process on the
machine that held it cannot exist and nothing is ever cleaned up. The file's text (host, pid, since, command) is for
the message only; it never decides anything. The descriptor is not inherited by child processes (desktops, Xvfb).

On shared file systems: NFS (v4, or v3 with its lock manager) and GPFS lock a whole file for every client; Lustre
only when mounted with ``-o flock`` (with ``localflock`` each node sees its own claims only, without either the
call fails). Where the file system cannot lock, the process runs unclaimed as before, and says so
(``Claim.enforced`` False, ``Claim.why``). A node that died holding a claim on NFS keeps it until the server's lease
for that client expires (90 s by default), which is why a claim can wait (``wait_s``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RUN = "run"
"""the claim of a whole run: ``computerrl run`` (its supervisor, locally or in a Slurm job) and a job's submission"""

CLAIMS_DIR = "claims"
"""the run directory's folder of claim files"""

_HELD: dict[Path, int] = {}  # claim file -> open descriptor, for this process's life (or ``release``)


class ClaimHeld(RuntimeError):
    """Another live process holds the claim; ``holder`` says who (as it wrote it; "" when unreadable)."""

    def __init__(self, name: str, path: Path, holder: str, waited_s: float):
        self.name, self.path, self.holder = name, path, holder
        waited = f" (waited {waited_s:.0f} s)" if waited_s else ""
        super().__init__(f"{path.parent.parent}: {name} is held by another process: "
                         f"{holder or 'holder unknown'}{waited} ({path})")


@dataclass(frozen=True)
class Claim:
    name: str
    path: Path
    enforced: bool
    """False where the file system could not lock: the process runs unclaimed (``why`` says what failed)"""
    why: str = ""


def claim(root: str | Path, name: str, wait_s: float = 0.0, poll_s: float = 0.25) -> Claim:
    """Claim ``name`` in the run directory ``root`` for the rest of this process's life, waiting up to ``wait_s``
    for a holder to go. ``ClaimHeld`` if it does not; a claim this process already holds is returned as it is."""
    path = Path(root).resolve() / CLAIMS_DIR / f"{name}.lock"
    if path in _HELD:
        return Claim(name, path, True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        return Claim(name, path, False, f"cannot open {path}: {exc.strerror or exc}")
    deadline = time.monotonic() + max(0.0, wait_s)
    started = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                return Claim(name, path, False, f"flock on {path}: {exc.strerror or exc} (this file system "
                                                f"does not lock: nothing stops a second process here)")
        if time.monotonic() >= deadline:
            holder = _holder(fd)
            os.close(fd)
            raise ClaimHeld(name, path, holder, time.monotonic() - started if wait_s else 0.0)
        time.sleep(poll_s)
    _HELD[path] = fd
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_me()) + "\n").encode(), 0)
    except OSError:  # a full disk: the claim holds; only the message a second process prints is poorer
        pass
    return Claim(name, path, True)


def release_all() -> None:
    """Give back every claim this process holds, before it ends: for a process that runs commands in-process one
    after another on the same run directories (a test session)."""
    while _HELD:
        os.close(_HELD.popitem()[1])  # closing the only descriptor drops the flock


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "command": " ".join(sys.argv)[:300]}


def _holder(fd: int) -> str:
    """Who holds the claim, from what it wrote: 'pid 123 on host h since T, Slurm job J: command'."""
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(who, dict) or "pid" not in who:
        return ""
    job = f", Slurm job {who['slurm_job']}" if who.get("slurm_job") else ""
    return f"pid {who['pid']} on host {who.get('host', '?')} since {who.get('since', '?')}{job}: " \
           f"{who.get('command', '')}"
