"""``computerrl eval``: success rate of a checkpoint on a task suite, per family, with 95 % (Wilson) intervals, in
one process.

Episodes run on in-process desktops (no broker, no server): sim desktops for ``sim:`` suites, real xvfb
desktops for ``desk`` suites, an outside backend's for its own kind of task ids (a few at a time, reused across
chunks); all episodes of a chunk advance together so their generations are batched. Decoding is greedy unless a
temperature is given. The prompt settings and desktops are the run's (its config.yaml next to the checkpoints), so
a policy is judged on the prompts it saw.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from actor.engine import SamplingParams
from actor.hf_engine import HFEngine
from actor.episode import play_concurrent
from actor.prompt import PromptConfig
from common.metrics.stats import wilson_interval
from env_server.sim.backend import SimBackend, SimConfig
from env_server.families import kind_of
from policy.saved import saved_model_config


def suite_tasks(suite: str, episodes: int, backend: str = "") -> list[str]:
    """``<kind>:<split>[:fam,...]`` -> task ids, ``episodes`` per family (seeds 0..N-1); kinds ``sim``, ``desk``, or
    that of ``backend`` (an outside env_server.backend)."""
    from env_server.backend_registry import registry_for

    tasks = registry_for(suite, backend)
    split, fams = tasks.parse_suite(suite)
    return [f"{tasks.kind}:{split}:{fam}/{seed}" for fam in dict.fromkeys(fams) for seed in range(episodes)]


def _desktop_pool(kind: str, env: Any, n: int) -> list[Any]:
    """Reused desktops of ``env``'s backend when it runs ``kind`` tasks (real desktops, MiniWoB, a plugin); ``desk``
    tasks of a run whose backend is the sim go to xvfb desktops of its ``desktop`` section."""
    from env_server.backend_registry import make_backend, task_kind

    if env is not None and task_kind(env.backend) == kind:
        return [make_backend(env, seed=i) for i in range(n)]
    if kind == "desk":
        from env_server.desktop.backend import DesktopConfig, XvfbBackend
        return [XvfbBackend(env.desktop if env is not None else DesktopConfig()) for _ in range(n)]
    raise ValueError(f"{kind!r} tasks need the env_server.backend that runs them (pkg.module:PLUGIN)")


def evaluate(engine: HFEngine, task_ids: list[str], prompt_cfg: PromptConfig, sampling: SamplingParams,
             max_steps: int = 0, chunk: int = 64, env: Any = None, record: Any = None,
             version: int | None = None) -> dict:
    """Greedy (or sampled) episodes of ``task_ids``; ``env`` (an EnvServerConfig) makes the desktops of ``desk``
    tasks (its ``desktop`` section) and of an outside backend's tasks (its ``backend`` and ``options``). With
    ``record`` (a ``common.episode_log.EpisodeWriter``) every episode is written to the run's episode log, labelled
    with the policy ``version`` evaluated."""
    from actor.recorder import episode_record
    per_family: dict[str, list[int]] = {}
    steps = format_errors = 0
    kind = kind_of(task_ids[0]) if task_ids else "sim"
    real = kind != "sim"
    if real:
        chunk = min(chunk, 4)  # real desktops cost hundreds of MB each: a few, reused
        pool = _desktop_pool(kind, env, min(chunk, len(task_ids)))
    try:
        for i in range(0, len(task_ids), chunk):
            ids = task_ids[i:i + chunk]
            shots = "png" if prompt_cfg.observation != "tree" else "none"
            envs = pool[:len(ids)] if real else [SimBackend(SimConfig(screenshot=shots)) for _ in ids]
            episodes = asyncio.run(play_concurrent(envs, ids, engine, sampling, engine.tokenizer, prompt_cfg, max_steps))
            if record is not None:
                record.offer([episode_record(ep, uuid.uuid4().hex[:12], "eval", eval_version=version)
                              for ep in episodes])
            for ep in episodes:
                steps += len(ep.turns)
                format_errors += ep.format_errors
                per_family.setdefault(ep.evaluation["family"], []).append(int(ep.evaluation["success"]))
    finally:
        for env in pool if real else ():
            env.close()
    total = sum(sum(v) for v in per_family.values())
    n = sum(len(v) for v in per_family.values())

    def ci95(k: int, m: int) -> list[float]:
        return [round(x, 4) for x in wilson_interval(k, m)]
    return {"success_rate": round(total / max(n, 1), 4), "ci95": ci95(total, n), "episodes": n,
            "per_family": {f: round(sum(v) / len(v), 4) for f, v in sorted(per_family.items())},
            "per_family_ci95": {f: ci95(sum(v), len(v)) for f, v in sorted(per_family.items())},
            "format_error_rate": round(format_errors / max(steps, 1), 4), "mean_steps": round(steps / max(n, 1), 2)}


def load_policy(checkpoint: str | Path, config: Any) -> tuple[HFEngine, PromptConfig, SamplingParams, int]:
    """The checkpoint's engine, and the prompt/sampling/step settings of ``config`` (the checkpoint's run config:
    ``launch.config.config_for_checkpoint``)."""
    from actor.engine import EngineConfig

    model_cfg = saved_model_config(checkpoint, config.model)
    prompt, sampling = config.actor.prompt, config.actor.sampling
    engine = HFEngine(model_cfg, EngineConfig(seed=0, max_batch=64).fitted(prompt.max_prompt_tokens,
                                                                           sampling.max_new_tokens))
    return engine, prompt, sampling, config.actor.max_steps
