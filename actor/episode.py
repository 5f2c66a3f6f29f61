"""The one episode loop: observe, build the prompt, ask the policy, step the desktop, until done; then evaluate.

Every caller plays episodes through ``play_episode`` so that a policy is trained, evaluated and demonstrated on the
same prompts: the actor (remote desktops on env_servers, the engine behind a batcher), ``computerrl eval``
(in-process desktops, generations batched across episodes) and demonstration recording (an oracle as the policy).
Desktops and policies are awaitables, so one asyncio loop interleaves many episodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from actor.engine import Generation
from actor.prompt import EpisodePrompt, PromptConfig
from common import protocol as P
from common.images import Image

OBS_TEXT_KEEP = 2000  # observation text kept per turn in a trajectory (debugging only)


class EpisodeEnv(Protocol):
    """A desktop as an episode sees it (an env_server session, or an in-process backend)."""

    async def reset(self, task_id: str) -> dict: ...

    async def step(self, action: str) -> Any: ...  # .obs, .done, .format_error, .info

    async def evaluate(self) -> dict: ...  # reward, success, ...


class Policy(Protocol):
    """Maps the prompt ids and its images (and the observation they render) to one generation; None ends the
    episode. A policy that keeps images for the learner stores them here, before the trajectory is sent."""

    async def __call__(self, prompt_ids: list[int], obs: dict, images: list[Image]) -> Generation | None: ...


@dataclass
class Episode:
    """One played episode: its turns (token-in/token-out, rewards not yet assigned) and the verdict."""

    task_id: str
    turns: list[P.TurnView]
    evaluation: dict
    finish_reason: str
    step_seconds: list[float] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    """per turn, what the desktop answered (its ``last_result``: the action's result or its error)"""
    instruction: str = ""

    @property
    def format_errors(self) -> int:
        return sum(int(t.format_error) for t in self.turns)

    def trajectory(self, traj_id: str) -> P.Trajectory:
        """The trajectory with step-level credit (ComputerRL): a well-formed turn earns the episode's reward."""
        reward = float(self.evaluation["reward"])
        turns = [dataclasses.replace(t, reward=0.0 if t.format_error else reward) for t in self.turns]
        return P.Trajectory.from_turns(traj_id, reward, bool(self.evaluation["success"]), turns,
                                       finish_reason=self.finish_reason, instruction=self.instruction)


async def play_episode(env: EpisodeEnv, policy: Policy, task_id: str, tokenizer: Any, prompt_cfg: PromptConfig,
                       max_steps: int = 0) -> Episode:
    """Play ``task_id`` on ``env`` with ``policy``; ``max_steps`` = 0 leaves the step limit to the desktop."""
    loop = asyncio.get_running_loop()
    obs = first = await env.reset(task_id)
    prompt = EpisodePrompt(tokenizer, prompt_cfg, obs.get("instruction", ""))
    turns: list[P.TurnView] = []
    seconds: list[float] = []
    results: list[str] = []
    finish = "truncated"
    while not max_steps or len(turns) < max_steps:
        ids = prompt.build(obs)
        images = list(prompt.images)
        gen = await policy(ids, obs, images)
        if gen is None:
            finish = "policy_stopped"
            break
        t0 = loop.time()
        step = await env.step(gen.text)
        seconds.append(loop.time() - t0)
        n = len(gen.token_ids)
        turns.append(P.TurnView(np.asarray(ids, np.int32), np.asarray(gen.token_ids, np.int32),
                                np.asarray(gen.logprobs, np.float32), np.asarray(gen.versions, np.int32),
                                np.ones(n, np.uint8), 0.0, bool(step.format_error),
                                str(obs.get("text", ""))[:OBS_TEXT_KEEP], gen.text,
                                tuple(img.digest for img in images)))
        results.append(str(step.obs.get("last_result", "")))
        prompt.record(gen.token_ids, results[-1])
        obs = step.obs
        if step.done:
            finish = str(step.info.get("outcome") or ("ended" if step.info.get("ended") else "step_limit"))
            break
    return Episode(task_id, turns, await env.evaluate(), finish, seconds, results, str(first.get("instruction", "")))


class LocalEnv:
    """An in-process desktop backend (sim or real) as an ``EpisodeEnv``: its calls run inline."""

    def __init__(self, backend: Any):
        self.backend = backend

    async def reset(self, task_id: str) -> dict:
        return self.backend.reset(task_id)

    async def step(self, action: str) -> Any:
        return self.backend.step(action)

    async def evaluate(self) -> dict:
        return self.backend.evaluate()


class EnginePolicy:
    """An engine as a policy: each turn is submitted as it comes and joins the engine's running batch (the
    engine batches continuously, so concurrent episodes share its decode steps without waiting for each other)."""

    def __init__(self, engine: Any, sampling: Any):
        self.engine, self.sampling = engine, sampling

    async def __call__(self, prompt_ids: list[int], obs: dict, images: list[Image]) -> Generation:
        return await asyncio.wrap_future(self.engine.submit(prompt_ids, self.sampling, images))


async def play_concurrent(envs: list[Any], task_ids: list[str], engine: Any, sampling: Any, tokenizer: Any,
                          prompt_cfg: PromptConfig, max_steps: int = 0) -> list[Episode]:
    """One episode per (in-process backend, task id), all played at once on one engine."""
    policy = EnginePolicy(engine, sampling)
    return list(await asyncio.gather(*(play_episode(LocalEnv(b), policy, t, tokenizer, prompt_cfg, max_steps)
                                       for b, t in zip(envs, task_ids))))
