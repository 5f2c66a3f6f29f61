"""Stop requests from signals (SIGTERM, SIGINT, Slurm's SIGUSR2, a lost terminal's SIGHUP), made without taking a lock.

A Python signal handler runs in the main thread between two bytecodes, possibly in the middle of code that holds a
lock (``threading.Event.set`` holds its condition's lock; a second signal can arrive while the first handler is in
there). A handler that takes the same lock waits for itself forever: a learner hit by two SIGTERMs hung that way.
So the handler only writes an attribute, and the role's loop, which polls anyway, acts on it outside the handler.

A role that runs as a scheduler's job step (``srun``) can get a TERM that its supervisor did not send: a Slurm
preemption signals every step's tasks at once (measured on Slurm 22.05: each step's tasks get TERM when the job is
picked for preemption, the batch shell only when its grace time ends). Stopping on it, every role would leave in no
order, the broker before the learner's last commit. So the supervisor starts every role but the learner with
``DEFER_TERM_ENV`` set: such a role counts a TERM (``deferred_terms``) and goes on until the supervisor stops it
with USR2, in order. The learner stops on it and checkpoints; its exit is how the supervisor learns of the
preemption (``launch/local.py``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Iterable

DEFER_TERM_ENV = "COMPUTERRL_DEFER_TERM"
"""set to 1 in a role's environment: a TERM is noted, not acted on (a scheduler's job step whose supervisor stops it
with USR2; above)"""


_deferred = [0]  # TERMs this process noted and did not act on (a list: a handler writes it without a lock)


def term_deferred() -> bool:
    """Whether this process notes a TERM rather than stopping on it (``DEFER_TERM_ENV``)."""
    return os.environ.get(DEFER_TERM_ENV) == "1"


def deferred_terms() -> int:
    """How many TERMs this process noted under ``DEFER_TERM_ENV`` (a role's counters carry it)."""
    return _deferred[0]


def _note_term(_signum: int, _frame: object) -> None:
    _deferred[0] += 1


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGHUP)
"""what asks a role to stop cleanly: TERM and INT; USR2 — Slurm's notice, and the one signal a supervisor can send
through ``srun`` to a role (srun answers TERM by killing its tasks, and forwards USR2 to them); and HUP, the terminal
a run was started from gone (an ssh session lost), whose default killed ``computerrl run`` where it stood"""


class StopSignals:
    """Set by the first of ``signals`` delivered to this process; read with ``requested`` (no lock either way)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0

    def install(self, signals: Iterable[int] = STOP_SIGNALS) -> "StopSignals":
        """Install the handlers (only the main thread may; elsewhere this does nothing and ``requested`` stays
        False). Under ``DEFER_TERM_ENV`` a TERM is only counted (``deferred_terms``)."""
        if threading.current_thread() is threading.main_thread():
            defer = term_deferred()
            for sig in signals:
                signal.signal(sig, _note_term if defer and sig == signal.SIGTERM else self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.requested = True


def unwind_on_term() -> None:
    """Make SIGTERM (and SIGUSR2, a supervisor's stop through ``srun``, and SIGHUP) unwind this process like Ctrl-C
    does:
    ``SystemExit(128 + signal)`` raised in the main thread, so every ``finally`` runs (browsers and desktops closed,
    files flushed) before it exits. Python's default for TERM and USR2 is to die where it stands, which left a killed
    ``computerrl pretrain``'s Chromium browsers running, re-parented to init. Signals that arrive while it unwinds
    are ignored, so a second one cannot cut the clean-up short (KILL still can). Under ``DEFER_TERM_ENV`` a TERM is
    only counted (USR2 still unwinds). Commands that stop by a loop of their own (the roles, ``run``,
    ``sweep``) install their handlers over this one. Only the main thread may install handlers; elsewhere this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_stop(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, _note_term if term_deferred() else on_stop)
    signal.signal(signal.SIGUSR2, on_stop)
    signal.signal(signal.SIGHUP, on_stop)  # (its terminal gone: the same clean-up)
