"""A role's sign of life for its supervisor: the modification time of one file, touched from the role's main loop.

A role that died is seen by its exit; a role that hangs for good (a deadlock, a process stopped and never continued,
a main loop stuck in a call that never returns) exits never, and the other roles only declare it dead on the wire.
The supervisor starts every role with ``PULSE_ENV`` naming a file of the run directory; the role's main loop calls
``beat()`` every pass, which touches that file at most once per ``BEAT_EVERY_S``. The supervisor restarts a role
whose file stopped changing (``local.hang_timeout_s``, ``launch/local.py``).

A file, not a socket: under Slurm the roles run on other nodes than the supervisor, and the run directory is the one
thing they all share. The supervisor compares modification times with each other, never with its own clock, so
clock skew between nodes and a shared file system's attribute cache only delay what it sees. Touching a file
allocates no block, so a full disk does not stop the beat.

Only the thread that runs a role's loop beats, so a role whose loop is stuck is seen even while its other threads
(a heartbeat sender, a training thread) carry on. A process that never calls ``beat()`` (a learner rank other than
0, which waits on its job channel for as long as rank 0 gives it nothing) creates no file, and is never taken for
hung.
"""

from __future__ import annotations

import os
import time

PULSE_ENV = "COMPUTERRL_PULSE_FILE"
"""the file a role touches to say it is alive (set by the supervisor; unset: no beat)"""

BEAT_EVERY_S = 0.5
"""the file is touched at most this often (a utime twice a second: nothing beside a role's loop)"""

_state = {"path": None, "last": -BEAT_EVERY_S, "failures": 0}  # the path is read from the environment once


def beat(now: float | None = None) -> None:
    """Tell the supervisor this role's loop is running: touch ``PULSE_ENV``'s file, at most once per ``BEAT_EVERY_S``.
    An error (the run directory gone, read-only) is counted (``counters``), never raised: a role that cannot beat
    is restarted by a supervisor that can see that, and one that can see nothing has nothing to restart."""
    now = time.monotonic() if now is None else now
    if now - _state["last"] < BEAT_EVERY_S:
        return
    _state["last"] = now
    path = _state["path"]
    if path is None:
        path = _state["path"] = os.environ.get(PULSE_ENV, "")
    if not path:
        return
    try:
        try:
            os.utime(path)
        except FileNotFoundError:  # the first beat (the supervisor removes the file before it starts the role)
            with open(path, "ab"):
                pass
    except OSError:
        _state["failures"] += 1


def counters() -> dict[str, int]:
    """What a role's counters carry of its beats: ``pulse_failures``, the beats it could not write, once there is one
    (a role that cannot beat may be taken for hung)."""
    return {"pulse_failures": _state["failures"]} if _state["failures"] else {}
