"""The desktop backend interface the session server drives.

A backend owns one desktop. The server calls ``reset(task_id)`` at the start of an episode, ``step(text)``
with the model's raw output each turn, ``evaluate()`` at the end, ``healthy()`` between episodes, and
``close()`` when the desktop is retired; ``scripted_actions()`` plays the current task's solver (demonstrations).
The simulated desktop (``env_server/sim/backend.py``), the real ones (xvfb, apptainer: ``env_server/desktop/``)
and MiniWoB (``env_server/miniwob/``) implement them; ``blocking`` tells the server to run their calls on worker
threads with a step timeout. ``env_server/backend_registry.py`` names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from env_server.actions import ActionError, parse_action


@dataclass
class StepResult:
    """What one step returns to the actor."""

    obs: dict
    done: bool
    format_error: bool = False
    action_error: bool = False
    info: dict = field(default_factory=dict)


class BackendError(RuntimeError):
    """The desktop itself failed (not the agent's action): the episode is aborted, the desktop replaced."""


class Backend:
    """Interface of a desktop backend."""

    name = ""
    blocking = False

    def reset(self, task_id: str) -> dict:
        raise NotImplementedError

    def step(self, text: str) -> StepResult:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def scripted_actions(self, route: str = "gui", rng: Any = None, demo: Any = None) -> Iterator[str]:
        """The current task's scripted solver as the actions a model would write, read off the live desktop as they
        are taken (demonstrations are played this way). ``route`` (gui | api), ``rng`` and ``demo`` (imperfection
        settings) mean something only to desktops whose solvers have such choices."""
        raise ActionError(f"the {self.name or type(self).__name__} backend has no scripted solvers")

    def _apply_text(self, text: str, act) -> tuple[bool, bool]:
        """Parse the model's output and run it with ``act(action) -> result text``: counts the step, keeps the
        result (or the error, for the next observation) in ``last_result``; returns (format_error, action_error)."""
        self.steps += 1
        try:
            action = parse_action(text)
        except ActionError as exc:
            self.format_errors += 1
            self.last_result = f"ERROR (format): {exc}"
            return True, False
        try:
            self.last_result = act(action)
        except ActionError as exc:
            self.last_result = f"ERROR: {exc}"
            return False, True
        return False, False


