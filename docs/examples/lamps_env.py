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
from env_server.backend import TaskBackend
from env_server.backend_registry import Plugin
from env_server.families import Task, TaskFamily, TaskRegistry, worded

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
    phrasings=worded("Turn on lamp {lamp}.", "Switch lamp {lamp} on.", "Make sure lamp {lamp} is lit.",
                     words=lambda p: {"lamp": p["target"] + 1}),  # the last wording is held out
    setup=lambda p: list(p["on"]),
    verify=lambda p, on: on[p["target"]],
    solve=lambda p, on: _toggle_to(on, [x or i == p["target"] for i, x in enumerate(on)]),
    max_steps=4))

TASKS.register(TaskFamily(
    name="all_off",
    generate=_panel,
    phrasings=worded("Turn every lamp off.", "Switch all the lamps off.", "Leave no lamp lit."),
    setup=lambda p: list(p["on"]),
    verify=lambda p, on: not any(on),
    solve=lambda p, on: _toggle_to(on, [False] * len(on)),
    max_steps=8))


# ----- the desktop: four methods; TaskBackend does the rest --------------------------------------------------

class LampPanel(TaskBackend):
    """One panel. ``TaskBackend`` turns task ids into instances, counts steps and format errors, ends an episode at
    done(), fail() or the step limit, and plays and judges it with the family's ``solve`` and ``verify``.
    ``blocking = False``: calls are instant, so the env_server runs them on its loop."""

    name = "lamps"

    def __init__(self, max_steps: int, seed: int):
        super().__init__(TASKS, max_steps)  # max_steps 0: each family's own limit
        self.seed = seed
        self.on: list[bool] = []

    def start(self, task: Task) -> None:
        self.on = TASKS.families[task.family].setup(task.params)

    def state(self) -> list[bool]:  # what the families' verify and solve read
        return list(self.on)

    def act(self, action: Action) -> str:
        if action.name != "click" or action.params.get("target") is None:
            raise ActionError(f"{action.name} does nothing on this panel: click(<lamp number>) or done()")
        target = action.params["target"]
        ids = {str(i + 1): i for i in range(len(self.on))} | {f"lamp {i + 1}": i for i in range(len(self.on))}
        i = ids.get(str(target).lower())
        if i is None:
            raise ActionError(f"no lamp {target!r} (lamps 1..{len(self.on)})")
        self.on[i] = not self.on[i]
        return f"lamp {i + 1} is {'on' if self.on[i] else 'off'}"

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
