"""SIGTERM unwinds a command like Ctrl-C (``common.signals.unwind_on_term``): its ``finally`` blocks run, a second
TERM cannot cut them short, and it exits 143. (The browser-level check, a terminated MiniWoB command leaving no
Chromium behind, is ``tests/test_miniwob.py::test_a_terminated_command_closes_its_browsers``.)"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

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


def test_sigterm_runs_the_finally_blocks_once_and_exits_143(tmp_path):
    marker = tmp_path / "closed"
    proc = subprocess.Popen([sys.executable, "-c", COMMAND, str(marker)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "unwinding"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert marker.read_text() == "closed", "the clean-up finished despite the second TERM"
    finally:
        proc.kill()
        proc.wait()
