"""Oracle demonstrations of sim tasks, recorded as the actor would have recorded its own episodes.

Each demonstration is played on an in-process sim desktop and turned into a token-in/token-out trajectory
with the run's prompt settings (one turn per demo step: the prompt ids the actor would have built, then the
oracle's action ids and the end token). Behaviour cloning (``computerrl pretrain``) trains on them, and the
learner's anti-forgetting anchor (``learner.anchor``) replays them during RL.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from common import protocol as P


def record_demos(suite: str, count: int, prompt_cfg: Any, tokenizer: Any, route: str = "api",
                 detour_prob: float = 0.0, wrong_choice_prob: float = 0.0, seed: int = 0) -> list[P.Trajectory]:
    """Demonstrations of the first ``count`` task seeds of ``suite`` (``sim:<split>[:fam,...]``).

    ``route``: api | gui | mixed (a random one per demo); ``detour_prob`` and ``wrong_choice_prob`` make
    demos imperfect (harmless detours, the wrong item on ambiguous screens). Deterministic for its arguments."""
    from actor.prompt import EpisodePrompt
    from env_server.sim.backend import SimBackend, demonstrate
    from env_server.sim import tasks as T

    T.parse_suite(suite)  # a clear error for a bad suite before any work
    if route not in ("api", "gui", "mixed"):
        raise ValueError(f"demo route must be api, gui or mixed, not {route!r}")
    demo = T.DemoConfig(detour_prob, wrong_choice_prob)
    rng = random.Random(seed)
    backend = SimBackend()
    end = tokenizer.special("<|end|>")
    out = []
    for task_seed in range(count):
        task_route = route if route != "mixed" else rng.choice(("api", "gui"))
        d = demonstrate(backend, f"{suite}/{task_seed}", task_route, demo, seed=seed)
        prompt = EpisodePrompt(tokenizer, prompt_cfg, d.steps[0][0]["instruction"] if d.steps else "")
        turns = []
        for k, (obs, action) in enumerate(d.steps):
            ids = prompt.build(obs)
            target = [*tokenizer.encode(action), end]
            n = len(target)
            turns.append(P.TurnView(np.asarray(ids, np.int32), np.asarray(target, np.int32), np.zeros(n, np.float32),
                                    np.zeros(n, np.int32), np.ones(n, np.uint8), 1.0, False, "", action))
            result = d.steps[k + 1][0].get("last_result", "") if k + 1 < len(d.steps) else ""
            prompt.record(target, str(result))
        if turns:
            out.append(P.Trajectory.from_turns(f"demo-{task_seed}", float(d.success), d.success, turns))
    return out
