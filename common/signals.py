"""Stop requests from signals (SIGTERM, SIGINT, Slurm's SIGUSR2), made without taking a lock.

A Python signal handler runs in the main thread between two bytecodes, possibly in the middle of code that holds a
lock (``threading.Event.set`` holds its condition's lock; a second signal can arrive while the first handler is in
there). A handler that takes the same lock waits for itself forever: a learner hit by two SIGTERMs hung that way.
So the handler only writes an attribute, and the role's loop, which polls anyway, acts on it outside the handler.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Iterable


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
"""what asks a role to stop cleanly: TERM and INT, and USR2 — Slurm's notice, and the one signal a supervisor can
send through ``srun`` to a role (srun answers TERM by killing its tasks, and forwards USR2 to them)"""


class StopSignals:
    """Set by the first of ``signals`` delivered to this process; read with ``requested`` (no lock either way)."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0

    def install(self, signals: Iterable[int] = STOP_SIGNALS) -> "StopSignals":
        """Install the handlers (only the main thread may; elsewhere this does nothing and ``requested`` stays
        False)."""
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.requested = True


def unwind_on_term() -> None:
    """Make SIGTERM unwind this process like Ctrl-C does: ``SystemExit(143)`` raised in the main thread, so every
    ``finally`` runs (browsers and desktops closed, files flushed) before it exits. Python's default for TERM is
    to die where it stands, which left a killed ``computerrl pretrain``'s Chromium browsers running, re-parented to
    init. TERMs that arrive while it unwinds are ignored, so a second one cannot cut the clean-up short (KILL still
    can). Commands that stop by a loop of their own (the roles, ``run``, ``sweep``) install their handlers over
    this one. Only the main thread may install handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
