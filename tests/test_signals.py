"""SIGTERM unwinds a command like Ctrl-C (``common.signals.unwind_on_term``): its ``finally`` blocks run, a second
TERM cannot cut them short, and it exits 143; a role that defers TERM only counts it. (The browser-level check, a
terminated MiniWoB command leaving no Chromium behind, is
``tests/test_miniwob.py::test_a_terminated_command_closes_its_browsers``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMAND = """
import sys, time
from pathlib import Path
from common.signals import unwind_on_term
unwind_on_term()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("unwinding", flush=True)
    time.sleep(0.5)  # the second TERM lands here
    Path(sys.argv[1]).write_text("closed")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_runs_the_finally_blocks_once_and_exits_143(tmp_path, sig):
    """And a HUP (its terminal closed) the same way, exit 129: by default it died where it stood."""
    marker = tmp_path / "closed"
    proc = subprocess.Popen([sys.executable, "-c", COMMAND, str(marker)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        assert proc.stdout.readline().strip() == "unwinding"
        proc.send_signal(sig)
        assert proc.wait(10) == 128 + sig
        assert marker.read_text() == "closed", "the clean-up finished despite the second signal"
    finally:
        proc.kill()
        proc.wait()


DEFERRING = """
import sys, time
from common.signals import deferred_terms, unwind_on_term
unwind_on_term()
try:
    print("ready", flush=True)
    while deferred_terms() < 2:
        time.sleep(0.01)
    print("deferred", deferred_terms(), flush=True)
    time.sleep(60)
finally:
    print("unwinding", flush=True)
"""


def test_a_role_that_defers_term_counts_it_and_still_stops_on_usr2(tmp_path):
    """Under ``COMPUTERRL_DEFER_TERM`` (a scheduler's job step, not the learner) a TERM is counted, not acted on: a
    Slurm preemption TERMs every step at once, and the supervisor stops them in order with USR2, which unwinds."""
    from common.signals import DEFER_TERM_ENV

    proc = subprocess.Popen([sys.executable, "-c", DEFERRING], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1], env={**os.environ, DEFER_TERM_ENV: "1"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # two signals, not one merged pending signal
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "deferred 2"
        assert proc.poll() is None, "two TERMs and still serving"
        proc.send_signal(signal.SIGUSR2)
        assert proc.stdout.readline().strip() == "unwinding"
        assert proc.wait(10) == 128 + signal.SIGUSR2
    finally:
        proc.kill()
        proc.wait()
