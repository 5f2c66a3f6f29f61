"""structlog set-up: JSON lines per process, a console renderer when stderr is a terminal.

Every line carries ``run_id``, ``role`` and ``rank``; roles bind ``policy_version`` as it changes
(``bind(policy_version=v)``). Loggers are not cached, so tests can reconfigure and capture them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

from common.appendfile import BestEffortAppender

_FILE: BestEffortAppender | None = None


class _Sink:
    """Final processor: JSON line to the process's log file (best-effort: a full disk drops lines, and the next line
    written says how many, as ``log_lines_dropped``); console text or JSON to stderr."""

    def __init__(self, file: BestEffortAppender | None, stream: TextIO | None, console: bool):
        self.file, self.stream = file, stream
        self.json = structlog.processors.JSONRenderer()
        self.pretty = structlog.dev.ConsoleRenderer(colors=False) if console else None

    def __call__(self, logger: Any, name: str, event_dict: dict) -> str:
        line = self.json(logger, name, dict(event_dict))
        if self.file is not None:
            if self.file.dropped:  # (rare: rendered again, with the count)
                self.file.write(self.json(logger, name, {**event_dict, "log_lines_dropped": self.file.dropped}) + "\n")
            else:
                self.file.write(line + "\n")
        if self.stream is None:
            raise structlog.DropEvent
        return self.pretty(logger, name, event_dict) if self.pretty else line


def setup(role: str, run_id: str = "", rank: int = 0, log_dir: str | Path | None = None,
          level: str = "info", console: bool | None = None, quiet: bool = False) -> structlog.BoundLogger:
    """Configure logging for this process and return a logger bound with run_id/role/rank.

    JSON lines go to ``log_dir/<role>-<rank>.jsonl`` when a log dir is given. stderr gets the console
    renderer on a TTY, JSON lines otherwise, nothing when ``quiet`` (a supervisor shows its own view).
    """
    global _FILE
    quiet = quiet or os.environ.get("COMPUTERRL_QUIET") == "1"  # under `computerrl run`: files only
    if _FILE is not None:
        _FILE.close()
        _FILE = None
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        _FILE = BestEffortAppender(Path(log_dir) / f"{role}-{rank}.jsonl")
    if console is None:
        console = sys.stderr.isatty()
    levelno = logging.getLevelName(level.upper())
    if not isinstance(levelno, int):
        raise ValueError(f"unknown log level {level!r}")
    _PROCESS_KEYS.clear()
    _PROCESS_KEYS.update(run_id=run_id, role=role, rank=rank, pid=os.getpid())
    structlog.configure(
        processors=[
            _add_process_keys,
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _Sink(_FILE, None if quiet else sys.stderr, console),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger()


def get(**bind: Any) -> structlog.BoundLogger:
    """A logger with extra bound keys (the process-wide run_id/role/rank come from setup)."""
    return structlog.get_logger().bind(**bind)


def bind(**values: Any) -> None:
    """Bind keys on every later line of this process, from any thread (e.g. ``policy_version``)."""
    _PROCESS_KEYS.update(values)


# Process-wide keys: a plain dict, not context variables, which a new thread (a weight round, a training
# step) would not inherit.
_PROCESS_KEYS: dict[str, Any] = {}


def _add_process_keys(logger: Any, name: str, event_dict: dict) -> dict:
    for key, value in _PROCESS_KEYS.items():
        event_dict.setdefault(key, value)
    return event_dict
