"""Oracle demonstrations, played by the one episode loop (``actor/episode.py``) with the task's scripted solver
as the policy (``Backend.scripted_actions``: the sim's oracle, a real desktop's solver, MiniWoB's or a plugin's),
so a demo is recorded exactly as the actor records its own episodes: the prompt ids the actor would have built,
then the oracle's action ids and the end token. Behaviour cloning (``computerrl
pretrain``) trains on them, the learner's anti-forgetting anchor replays them, and the actors' workflow explorer
induces workflows from them (both sets recorded once per run into its directory by ``record_run_demos``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

from actor.engine import Generation
from actor.episode import Episode, LocalEnv, play_episode
from common import protocol as P

ROUTES = ("api", "gui", "mixed")


class OraclePolicy:
    """The task's scripted solver as a policy: reads the live desktop, answers with its next action (as the ids the
    tokenizer gives it plus the token that ends a turn); None once the script is over. Keeps what it saw."""

    def __init__(self, backend: Any, tokenizer: Any, route: str, demo: Any, rng: random.Random,
                 images: Any = None):
        self.backend, self.tok, self.route, self.demo, self.rng = backend, tokenizer, route, demo, rng
        self.images = images  # where a VLM's screenshots go (common.images.ImageStore), for whoever trains on them
        self.end = tokenizer.eos_id
        self.actions = None
        self.seen: list[tuple[dict, str]] = []  # (observation, action) per turn

    async def __call__(self, prompt_ids: list[int], obs: dict, images: list) -> Generation | None:
        if images and self.images is None:
            raise ValueError("demonstrations with screenshots need an image store to put them in")
        for img in images:
            self.images.put(img)
        if self.actions is None:
            self.actions = self.backend.scripted_actions(self.route, self.rng, self.demo)
        action = next(self.actions, None)
        if action is None:
            return None
        self.seen.append((obs, action))
        ids = [*self.tok.encode(action), self.end]
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop", action)


def demonstrate(backend: Any, task_id: str, route: str = "gui", demo: Any = None, seed: int = 0,
                tokenizer: Any = None, prompt_cfg: Any = None,
                images: Any = None) -> tuple[Episode, list[tuple[dict, str]]]:
    """One oracle episode of ``task_id`` on ``backend``: the episode, and the (observation, action) pairs.
    ``images``: the store a VLM prompt's screenshots are put in."""
    from actor.prompt import PromptConfig
    from policy.tokenizer import ByteTokenizer
    tok = tokenizer or ByteTokenizer()
    policy = OraclePolicy(backend, tok, route, demo, random.Random(f"demo/{task_id}/{route}/{seed}"), images)
    episode = asyncio.run(play_episode(LocalEnv(backend), policy, task_id, tok, prompt_cfg or PromptConfig()))
    return episode, policy.seen


def local_backend(kind: str, prompt_cfg: Any, env: Any = None, seed: int = 0) -> Any:
    """An in-process desktop for tasks of ``kind``: a sim desktop, or one of ``env``'s backend (an EnvServerConfig
    whose backend runs that kind: real desktops, MiniWoB, a plugin). The caller closes it."""
    from env_server.backend_registry import make_backend
    from env_server.sim.backend import SimBackend, SimConfig

    if kind == "sim":
        return SimBackend(SimConfig(screenshot="png" if prompt_cfg.observation != "tree" else "none"))
    if env is None:
        raise ValueError(f"episodes of {kind!r} tasks need the env_server config of the desktops that run them")
    return make_backend(env, seed)


def record_demos(suite: str, count: int, prompt_cfg: Any, tokenizer: Any, route: str = "api",
                 detour_prob: float = 0.0, wrong_choice_prob: float = 0.0, seed: int = 0,
                 images: Any = None, env: Any = None) -> list[P.Trajectory]:
    """Demonstrations of the first ``count`` task seeds of ``suite`` (``<kind>:<split>[:fam,...]``).

    ``sim`` suites play on a sim desktop; any other kind on a desktop of ``env`` (an EnvServerConfig whose backend
    runs that kind: real desktops, MiniWoB, a plugin), closed afterwards. ``route``: api | gui | mixed (a random
    one per demo); ``detour_prob`` (sim only: a harmless detour) and ``wrong_choice_prob`` (the wrong item on
    an ambiguous screen, for any desktop whose families have ``wrong`` solvers: the sim's, MiniWoB's) make demos
    imperfect. Deterministic for its arguments. A prompt that shows screenshots
    (``prompt_cfg.observation``) gets them rendered, and put in ``images``."""
    from env_server.backend_registry import task_registry
    from env_server.families import kind_of
    from env_server.sim import families as sim_tasks

    kind = kind_of(suite)
    task_registry(kind, env.backend if env is not None else "").parse_suite(suite)  # a bad suite fails here
    if route not in ROUTES:
        raise ValueError(f"demo route must be api, gui or mixed, not {route!r}")
    demo = sim_tasks.DemoConfig(detour_prob, wrong_choice_prob)
    rng = random.Random(seed)
    backend = local_backend(kind, prompt_cfg, env, seed)
    out = []
    try:
        for task_seed in range(count):
            task_route = route if route != "mixed" else rng.choice(("api", "gui"))
            episode, seen = demonstrate(backend, f"{suite}/{task_seed}", task_route, demo, seed, tokenizer,
                                        prompt_cfg, images)
            if episode.turns:  # with the rows each action was chosen on: what workflow induction reads
                trees = [[[list(c) if isinstance(c, tuple) else c for c in row] for row in obs.get("tree") or []]
                         for obs, _ in seen]  # as the wire gives them back: lists
                out.append(dataclasses.replace(episode.trajectory(f"demo/{suite}/{task_seed}"), trees=trees))
    finally:
        backend.close()
    return out


def record_run_demos(cfg: Any, run_dir: Any, log: Any = None) -> dict[str, int]:
    """Record each of the run's demonstration sets (``demofile.run_demo_sets``: the anchor's, the workflows')
    into the run directory, once: a file already recorded with its settings is kept. Returns how many demos each
    holds."""
    from common import demofile
    from common.images import ImageStore
    from env_server.families import kind_of
    from policy.model import build_tokenizer

    counts = {}
    for name, settings in demofile.run_demo_sets(cfg).items():
        path = run_dir.demos(name)
        try:
            counts[name] = len(demofile.load(path, settings))
            continue
        except demofile.DemoFileError:
            pass  # absent, or recorded for other settings: record anew
        t0 = time.monotonic()
        suite = settings["suite"]
        demos = record_demos(suite, settings["demos"], cfg.actor.prompt, build_tokenizer(cfg.model), settings["route"],
                             seed=settings["seed"], images=ImageStore(run_dir.images),
                             env=cfg.env_server if kind_of(suite) != "sim" else None)
        demofile.save(path, demos, settings)
        counts[name] = len(demos)
        if log is not None:
            log.info("demos_recorded", set=name, path=str(path), suite=suite, demos=len(demos),
                     turns=sum(d.num_turns for d in demos), seconds=round(time.monotonic() - t0, 2))
    return counts


def load_run_demos(cfg: Any, run_dir: Any, name: str) -> list[P.Trajectory] | None:
    """The run's demonstration set ``name`` as recorded (``record_run_demos``), or None when that set is off;
    ``DemoFileError`` when it is on but not recorded with this run's settings."""
    from common import demofile

    settings = demofile.run_demo_sets(cfg).get(name)
    return None if settings is None else demofile.load(run_dir.demos(name), settings)
