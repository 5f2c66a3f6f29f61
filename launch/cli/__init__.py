"""The ``computerrl`` command: one click group (``base.py``); each role is its own subcommand and process
(``role_commands.py``), whole runs (``run_commands.py``), Slurm jobs (``slurm_commands.py``), tools around a run
(``tool_commands.py``) and the benchmarks (``bench_commands.py``) register their commands on it when imported."""

from launch.cli import bench_commands, role_commands, run_commands, slurm_commands, tool_commands  # noqa: F401
from launch.cli.base import main

__all__ = ["main"]
