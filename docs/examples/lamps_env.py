"""A panel of lamp switches: an environment from outside computerrl, plugged in by import path.

    env_server:
      backend: lamps_env:PLUGIN      # this module must be importable by every role (installed, or on PYTHONPATH)
      options: {max_steps: 6}        # handed to PLUGIN.make; PLUGIN.check refuses a bad key by name
    broker:
      tasks: {suite: "lamps:train"}  # task ids are lamps:<split>[:family,...]/<seed>

Walk-through: docs/add-an-environment.md. tests/test_plugins.py runs this file from a folder outside the
repository: scripted solvers through the backend, a `computerrl run` on it and `computerrl eval` of the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from common.config import build
from env_server.actions import Action, ActionError
from env_server.backend import Backend, StepResult
from env_server.backend_registry import Plugin
from env_server.families import TaskFamily, TaskRegistry

TASKS = TaskRegistry("lamps")  # the prefix of this environment's task ids and suites


# ----- task families: what to ask, how to check it from the final state, how to solve it -----------------------

def _panel(rng: random.Random) -> dict:
    n = rng.randint(3, 5)
    return {"on": [rng.random() < 0.5 for _ in range(n)], "target": rng.randrange(n)}


def _toggle_to(on: list[bool], want: list[bool]) -> Iterator[str]:
    for i, (now, goal) in enumerate(zip(on, want)):
        if now != goal:
            yield f"click({i + 1})"
    yield "done()"


TASKS.register(TaskFamily(
    name="lamp_on",
    generate=_panel,
    phrasings=lambda p: (f"Turn on lamp {p['target'] + 1}.", f"Switch lamp {p['target'] + 1} on.",
                         f"Make sure lamp {p['target'] + 1} is lit."),
    setup=lambda p: list(p["on"]),
    verify=lambda p, on: on[p["target"]],
    solve=lambda p, on: _toggle_to(on, [x or i == p["target"] for i, x in enumerate(on)]),
    max_steps=4))

TASKS.register(TaskFamily(
    name="all_off",
    generate=_panel,
    phrasings=lambda p: ("Turn every lamp off.", "Switch all the lamps off.", "Leave no lamp lit."),
    setup=lambda p: list(p["on"]),
    verify=lambda p, on: not any(on),
    solve=lambda p, on: _toggle_to(on, [False] * len(on)),
    max_steps=8))


# ----- the desktop: five methods the env_server drives ---------------------------------------------------------

class LampPanel(Backend):
    """One panel. ``blocking = False``: calls are instant, so the env_server runs them on its loop."""

    name = "lamps"

    def __init__(self, max_steps: int, seed: int):
        self.max_steps_option, self.seed = max_steps, seed
        self.task, self.on, self.finished = None, [], False
        self.steps = self.format_errors = 0
        self.last_result = ""

    def reset(self, task_id: str) -> dict:
        self.task = TASKS.make_task(task_id)  # ActionError on a malformed id: the actor is told, nothing breaks
        self.on = TASKS.families[self.task.family].setup(self.task.params)
        self.finished, self.steps, self.format_errors, self.last_result = False, 0, 0, ""
        return self.observation()

    def step(self, text: str) -> StepResult:
        if self.task is None:
            raise ActionError("reset the session with a task first")
        format_error, action_error = self._apply_text(text, self._act)  # parses the API-GUI action, counts
        done = self.finished or self.steps >= (self.max_steps_option or self.task.max_steps)
        return StepResult(self.observation(), done, format_error, action_error)

    def _act(self, action: Action) -> str:
        if action.name == "done":
            self.finished = True
            return "finished"
        if action.name != "click" or action.params.get("target") is None:
            raise ActionError(f"{action.name} does nothing on this panel: click(<lamp number>) or done()")
        target = action.params["target"]
        ids = {str(i + 1): i for i in range(len(self.on))} | {f"lamp {i + 1}": i for i in range(len(self.on))}
        i = ids.get(str(target).lower())
        if i is None:
            raise ActionError(f"no lamp {target!r} (lamps 1..{len(self.on)})")
        self.on[i] = not self.on[i]
        return f"lamp {i + 1} is {'on' if self.on[i] else 'off'}"

    def scripted_actions(self, route: str = "gui", rng=None, demo=None) -> Iterator[str]:
        """The task's solver from the panel as it is now (what demonstrations are recorded from)."""
        return TASKS.families[self.task.family].solve(self.task.params, list(self.on))

    def evaluate(self) -> dict:
        if self.task is None:
            raise ActionError("no episode to evaluate")
        success = bool(TASKS.families[self.task.family].verify(self.task.params, self.on))
        return {"reward": float(success), "success": success, "family": self.task.family, "steps": self.steps,
                "format_errors": self.format_errors}

    def observation(self) -> dict:
        rows = [f"[{i + 1}] button 'Lamp {i + 1}' ({'on' if lit else 'off'})" for i, lit in enumerate(self.on)]
        return {"step": self.steps, "instruction": self.task.instruction, "text": "\n".join(rows),
                "last_result": self.last_result}


# ----- the plugin: options checked up front, desktops made from them ------------------------------------------

@dataclass
class LampOptions:
    """``env_server.options`` of this environment."""

    max_steps: int = 0
    """the episode's step limit (0 = the family's)"""

    def validate(self) -> None:
        if self.max_steps < 0:
            raise ValueError("max_steps must be >= 0 (0 = the family's)")


def check(options: dict) -> LampOptions:
    # computerrl's config builder types and checks a section; its errors name the key (env_server.options.colour)
    return build(LampOptions, options, "env_server.options")


def make(options: dict, seed: int) -> LampPanel:
    return LampPanel(check(options).max_steps, seed)


PLUGIN = Plugin(make=make, tasks=TASKS, check=check)
