"""Plug-ins the tests select by import path, as any outside one is: env_server backends (one module, so the test and
the server see the same classes) and a learner loss."""

from __future__ import annotations

import dataclasses
import os
import signal

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


POISON_LOGPROB = -77.0
"""a behaviour log-prob no model records: a test plants it in one group to make that group's step kill the learner"""


def _planted(inp) -> bool:
    """Whether a loss's micro-batch holds the planted log-prob."""
    return bool((inp.behav_logprobs == POISON_LOGPROB).any())


def killing_grpo_loss(inp, cfg):
    """The GRPO loss, except that a micro-batch holding the planted log-prob kills its process with SIGKILL (as the
    kernel's OOM killer, or a segfault in a kernel, would): with several ranks, the rank that got that group."""
    from learner.losses import grpo_loss

    if _planted(inp):
        os.kill(os.getpid(), signal.SIGKILL)
    return grpo_loss(inp, cfg)


def hanging_grpo_loss(inp, cfg):
    """The GRPO loss, except that a micro-batch holding the planted log-prob never returns (a kernel or a driver that
    hangs): the step it is in runs forever."""
    import time

    from learner.losses import grpo_loss

    if _planted(inp):
        while True:
            time.sleep(1)
    return grpo_loss(inp, cfg)
