"""What every part of the in-desktop agent shares: the error a request that does not fit the desktop raises, and
the agent's log line (its stderr is the desktop's log on the host)."""

from __future__ import annotations

import sys


class ActionFailure(Exception):
    """The request does not fit the desktop's state; reported to the model, the desktop is fine."""


def log(*parts: object) -> None:
    print("[agent]", *parts, file=sys.stderr, flush=True)
