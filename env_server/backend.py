"""The desktop backend interface the session server drives.

A backend owns one desktop. The server calls ``reset(task_id)`` at the start of an episode, ``step(text)``
with the model's raw output each turn, ``evaluate()`` at the end, ``healthy()`` between episodes, and
``close()`` when the desktop is retired; ``scripted_actions()`` plays the current task's solver (demonstrations).
``blocking`` tells the server to run a backend's calls on worker threads with a step timeout.
``env_server/backend_registry.py`` names the backends.

``TaskBackend`` is the base for a desktop whose tasks come from a ``TaskRegistry``: it owns what every such desktop
does alike, and leaves four methods to write. Every shipped desktop is one — the simulated desktop
(``env_server/sim/backend.py``), the real ones (xvfb, apptainer: ``env_server/desktop/``) and MiniWoB
(``env_server/miniwob/``) — and so is an environment of one's own (``docs/add-an-environment.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from env_server.actions import Action, ActionError, parse_action, result_text
from env_server.families import Task, TaskFamily, TaskRegistry


@dataclass
class StepResult:
    """What one step returns to the actor."""

    obs: dict
    """the observation after the step (``observation()``'s dict: ``text``, ``instruction``, ``last_result``, ...)"""
    done: bool
    """the episode is over: the agent said done() or fail(), or the step limit was reached"""
    format_error: bool = False
    """the output was not one well-formed action (the step still counts)"""
    action_error: bool = False
    """a well-formed action the desktop refused (no such target, ...): said in the next observation's last_result"""
    info: dict = field(default_factory=dict)
    """``outcome``: "done" or "fail" when the agent declared one, else None; ``ended``: the desktop itself ended the
    episode (a MiniWoB page that took its answer); ``truncated``: ended by the step limit. The actor records an
    episode's finish as its outcome, else "ended" or "step_limit"."""


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


class TaskBackend(Backend):
    """A desktop whose tasks come from a ``TaskRegistry``. It owns what every such desktop does alike: a task id
    made into its instance (``tasks.make_task``), the per-episode counters, the step limit (``max_steps``, else the
    family's), the agent's ``done()`` and ``fail()``, the ``StepResult.info`` fields, and playing and judging an
    episode with the family's own ``solve`` and ``verify``, both called as ``(params, state())`` (the verdict:
    ``TaskFamily.judge``: an infeasible task is solved only by ``fail()``, ``fail()`` on a feasible one fails it).

    What a subclass writes: ``start(task)`` (set the desktop up for the instance, e.g. from
    ``family.setup(task.params)``), ``state()`` (what ``verify`` and ``solve`` read), ``act(action)`` (one parsed
    action other than done/fail: its result text, or ``ActionError``), ``observation()`` (the dict the prompt
    shows: at least ``instruction``, ``text`` and ``last_result``). A desktop that can end an episode itself (a
    MiniWoB page that took its answer) says so in ``ended()``."""

    def __init__(self, tasks: TaskRegistry, max_steps: int = 0):
        self.tasks, self.max_steps = tasks, max_steps
        self.task: Task | None = None
        self.outcome: str | None = None
        """"done" or "fail" once the agent has said so this episode"""
        self.steps = self.format_errors = 0
        """this episode's steps, and those whose text was not one well-formed action"""
        self.last_result = ""
        """the last action's result, or its error: the next observation shows it"""

    @property
    def family(self) -> TaskFamily:
        return self.tasks.families[self._current().family]

    def _current(self) -> Task:
        if self.task is None:
            raise ActionError("reset the session with a task first")
        return self.task

    def step_limit(self) -> int:
        return self.max_steps or self._current().max_steps

    # ----- what a subclass writes ------------------------------------------------------------------

    def start(self, task: Task) -> None:
        raise NotImplementedError

    def state(self) -> Any:
        raise NotImplementedError

    def act(self, action: Action) -> str:
        raise NotImplementedError

    def observation(self) -> dict:
        raise NotImplementedError

    def ended(self) -> bool:
        """The desktop itself ended the episode (checked after each step, once ``observation()`` has run)."""
        return False

    # ----- the interface, done once ----------------------------------------------------------------

    def reset(self, task_id: str) -> dict:
        task = self.tasks.make_task(task_id)  # ActionError for an id this registry cannot read: the actor is told
        self.start(task)
        self.task, self.outcome = task, None
        self.steps, self.format_errors, self.last_result = 0, 0, ""
        return self.observation()

    def step(self, text: str) -> StepResult:
        self._current()
        format_error, action_error = self._apply_text(text)
        obs = self.observation()
        ended = self.outcome is None and self.ended()
        done = self.outcome is not None or ended or self.steps >= self.step_limit()
        return StepResult(obs, done, format_error, action_error,
                          {"outcome": self.outcome, "ended": ended, "truncated": done and self.outcome is None
                           and not ended})

    def _apply_text(self, text: str) -> tuple[bool, bool]:
        """Parse the model's output and run it (done/fail declared here, any other action by ``act``): counts the
        step, keeps the result (or the error, for the next observation) in ``last_result``; returns (format_error,
        action_error)."""
        self.steps += 1
        try:
            action = parse_action(text)
        except ActionError as exc:
            self.format_errors += 1
            self.last_result = f"ERROR (format): {exc}"
            return True, False
        try:
            self.last_result = self._declare_or_act(action)
        except ActionError as exc:
            self.last_result = f"ERROR: {exc}"
            return False, True
        return False, False

    def _declare_or_act(self, action: Action) -> str:
        if action.name in ("done", "fail"):
            self.outcome = action.name
            return result_text(action)  # the action contract's words: "episode ended: done"
        return self.act(action)

    def scripted_actions(self, route: str = "gui", rng: Any = None, demo: Any = None) -> Iterator[str]:
        task = self._current()
        return self.family.solver(demo, rng)(task.params, self.state())

    def evaluate(self) -> dict:
        task = self._current()
        success = self.family.judge(task.params, self.state(), self.outcome)
        return {"reward": float(success), "success": success, "family": task.family, "steps": self.steps,
                "format_errors": self.format_errors, "outcome": self.outcome}
