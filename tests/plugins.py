"""Backends the env_server tests select by import path, as any outside environment is (one module, so the test
and the server see the same classes)."""

from __future__ import annotations

import dataclasses

from env_server.backend_registry import Plugin
from env_server.sim.backend import SimBackend, SimConfig
from env_server.sim.families import TASKS as SIM_TASKS


class ExplodingBackend(SimBackend):
    """A desktop whose step raises on the action 'boom()' (a crashed app, a dead X server)."""

    name = "exploding"
    healthy_flag = True

    def step(self, text):
        if text == "boom()":
            raise RuntimeError("the desktop crashed")
        return super().step(text)

    def healthy(self):
        return ExplodingBackend.healthy_flag


# A backend from outside env_server, selected by import path like any plugin (tests/ is importable as a package).
EXPLODING = Plugin(make=lambda options, seed: ExplodingBackend(SimConfig(), seed), tasks=SIM_TASKS)



class NeverDoneBackend(SimBackend):
    """A plug-in with a bug: it never says an episode is done (not even at its task's step limit)."""

    name = "never_done"

    def step(self, text):
        return dataclasses.replace(super().step(text), done=False)


NEVER_DONE = Plugin(make=lambda options, seed: NeverDoneBackend(SimConfig(), seed), tasks=SIM_TASKS)
