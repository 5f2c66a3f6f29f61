"""``computerrl pretrain``: behaviour cloning on oracle demonstrations -> a base checkpoint for RL.

Demonstrations are recorded on in-process desktops (``actor.demos``, the actors' episode loop: sim desktops, or
those of the run's ``env_server.backend`` for its own task kind, e.g. MiniWoB) with the run's own prompt settings, so the model learns from exactly the token layout the actors will build:
every (prompt ids, action ids + end token) of every demo step is one SFT sample. Demonstrations can be
imperfect (``pretrain.detour_prob``, ``pretrain.wrong_choice_prob``) so that cloning alone is not the
ceiling. The result is a policy directory (HF-format safetensors + config + state.json with the prompt
layout) that ``model.path`` and ``computerrl eval`` take; the same command with the same config and seed
remakes it. (The shipped ``configs/base-policy`` predates the one LR schedule: its cosine ran from step 0 under
the warm-up rather than from the end of the warm-up, so a remake today differs from it in its first steps.)
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import protocol as P
from common.images import ImageStore


@dataclass
class PretrainConfig:
    """Behaviour cloning on oracle demonstrations (``computerrl pretrain``)."""

    kind: str = "sim"
    """task kind demonstrated: sim, or the kind of env_server.backend (desk, miniwob, a plugin's), by its solvers"""
    families: list[str] = field(default_factory=list)
    """task families to clone (empty = all sim families; other kinds must name theirs)"""
    route: str = "api"
    """oracle route shown: api | gui | mixed"""
    seeds: int = 2000
    """training-split seeds demonstrated (per family count = seeds / families)"""
    detour_prob: float = 0.0
    """share of demos with a harmless detour"""
    wrong_choice_prob: float = 0.0
    """share of demos taking the wrong item on ambiguous screens (families with a ``wrong`` solver: sim, MiniWoB)"""
    steps: int = 300
    """optimizer steps"""
    batch_samples: int = 32
    """demo steps per optimizer step"""
    lr: float = 1e-3
    """peak learning rate (the learner's schedule: linear warm-up, then cosine decay to 0 at ``steps``)"""
    warmup_steps: int = 50
    """linear warm-up steps"""
    init: str = "scratch"
    """scratch (seeded from the model fields; model.path, often this output, is ignored) | model (from model.path)"""
    seed: int = 0
    """sampling seed of demos and batches"""
    eval_episodes: int = 0
    """held-out episodes per cloned family evaluated (greedy) on the result; 0 = none"""
    eval_max_new_tokens: int = 64
    """tokens per action in that evaluation"""
    eval_max_steps: int = 12
    """turns per episode in that evaluation"""
    device: str = "cpu"
    """where the clone trains and is evaluated: cpu | cuda | cuda:N (demos are recorded on the CPU either way)"""
    workflow_episodes: int = 0
    """episodes per family explored with workflows induced from the demos, whose successes are cloned too; 0 = off"""

    def validate(self) -> None:
        if self.route not in ("api", "gui", "mixed"):
            raise ValueError("pretrain.route must be api, gui or mixed")
        if self.init not in ("scratch", "model"):
            raise ValueError("pretrain.init must be scratch or model")
        if self.seeds < 1 or self.steps < 1 or self.batch_samples < 1:
            raise ValueError("seeds, steps and batch_samples must be >= 1")
        if re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is None:
            raise ValueError(f"pretrain.device must be cpu, cuda or cuda:N, not {self.device!r}")
        if self.workflow_episodes < 0:
            raise ValueError("pretrain.workflow_episodes must be >= 0")
        if self.workflow_episodes and self.route == "api":
            raise ValueError("pretrain.workflow_episodes explores with GUI actions on tree rows: set pretrain.route=gui")
        if self.kind != "sim" and not self.families:
            raise ValueError(f"pretrain.kind {self.kind}: name the families to clone (pretrain.families)")

    def suite(self, split: str) -> str:
        from env_server.sim import families as sim_tasks

        return f"{self.kind}:{split}:{','.join(self.families or sim_tasks.FAMILY_NAMES)}"


def demo_trajectories(cfg: PretrainConfig, prompt_cfg: Any, tokenizer: Any, log: Any = None,
                      images: Any = None, env: Any = None) -> list[P.Trajectory]:
    """Record demonstrations as token-in/token-out trajectories (one turn per demo step); a VLM prompt's screenshots
    go to ``images`` (an ImageStore); tasks of another kind than ``sim`` play on desktops of ``env``."""
    from actor.demos import record_demos

    out = record_demos(cfg.suite("train"), cfg.seeds, prompt_cfg, tokenizer, cfg.route, cfg.detour_prob,
                       cfg.wrong_choice_prob, cfg.seed, images, env=env)
    if log is not None:
        log.info("demos_recorded", trajectories=len(out), steps=sum(t.num_turns for t in out))
    return out


def workflow_trajectories(cfg: PretrainConfig, demos: list[P.Trajectory], prompt_cfg: Any, tokenizer: Any,
                          env: Any = None) -> tuple[list[P.Trajectory], dict]:
    """Workflow-guided exploration from ``demos``: ``cfg.workflow_episodes`` episodes per family on training seeds
    after the demos' own, each following a workflow induced from a demo; the successful episodes, and what the
    explorer learned (per family: episodes, successes, dead ends, its most probable workflow)."""
    from actor.demos import local_backend
    from actor.workflow_explorer import ExplorerConfig, WorkflowExplorer, explore, workflows_of
    from env_server.backend_registry import task_registry

    registry = task_registry(cfg.kind, env.backend if env is not None else "")
    suite = cfg.suite("train")
    families = set(registry.parse_suite(suite)[1])
    explorer = WorkflowExplorer(workflows_of(demos, registry), ExplorerConfig(seed=cfg.seed), registry)
    missing = sorted(families - set(explorer.workflows))
    if missing:
        raise ValueError(f"no successful demonstration of {', '.join(missing)} to induce a workflow from: "
                         "raise pretrain.seeds")
    tasks = [f"{suite}/{cfg.seeds + i}" for i in range(cfg.workflow_episodes * len(families))]
    backend = local_backend(cfg.kind, prompt_cfg, env, cfg.seed)
    try:
        found = explore(explorer, backend, tasks, tokenizer, prompt_cfg)
    finally:
        backend.close()
    return found, explorer.summary()


def pretrain(cfg: PretrainConfig, model_cfg: Any, prompt_cfg: Any, out_dir: Path, log: Any,
             progress: Any = None, env: Any = None) -> dict:
    """``env``: the env_server config whose desktops play tasks of ``cfg.kind`` when it is not ``sim``."""
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    cfg.validate()
    if cfg.init == "scratch":
        # A scratch model still needs an hf tokenizer's files; a byte tokenizer needs none, so no host path is
        # recorded in the checkpoint (the shipped base policy must not name the machine that made it).
        from policy.tokenizer import resolved_kind
        tok_path = model_cfg.tokenizer_path or model_cfg.path
        tok_path = tok_path if resolved_kind(model_cfg.tokenizer, tok_path) == "hf" else ""
        model_cfg = dataclasses.replace(model_cfg, path="", tokenizer_path=tok_path)
    # Continuing from an earlier pretrain output: its record goes into ours, so the checkpoint says every stage.
    started_from = None
    if cfg.init == "model" and (Path(model_cfg.path) / "state.json").exists():
        started_from = json.loads((Path(model_cfg.path) / "state.json").read_text()).get("pretrain")
    # The learner's own LR schedule: linear warm-up, then cosine decay to 0 at the last step.
    schedule = LearnerConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule="cosine", total_steps=cfg.steps,
                             min_lr_ratio=0.0, keep_checkpoints=1, device=cfg.device)
    # A VLM's demo screenshots live in a store beside the output while it trains (the policy needs none after).
    images = ImageStore(Path(out_dir).with_name(f".{Path(out_dir).name}-images"))
    trainer = Trainer(schedule, model_cfg, seed=cfg.seed, images=images)
    t0 = time.monotonic()
    trajs = demo_trajectories(cfg, prompt_cfg, trainer.tokenizer, log, images, env)
    cloned: dict[str, Any] = {"demos": len(trajs)}  # what the clone is made of
    if cfg.workflow_episodes:
        found, per_family = workflow_trajectories(cfg, trajs, prompt_cfg, trainer.tokenizer, env)
        cloned.update(workflow_episodes=cfg.workflow_episodes * len(per_family), workflow_successes=len(found),
                      workflows=per_family)
        if log is not None:
            log.info("workflows_explored", episodes=cloned["workflow_episodes"], successes=len(found))
        trajs = trajs + found
    # One sample per demo step: split trajectories into single-turn pieces so batches mix tasks and steps.
    pieces = []
    for tr in trajs:
        for k in range(tr.num_turns):
            tv = tr.turn(k)
            pieces.append(P.Trajectory.from_turns(f"{tr.traj_id}-{k}", 1.0, True, [tv]))
    rng = random.Random(cfg.seed)
    losses = []
    for step in range(cfg.steps):
        batch = rng.sample(pieces, min(cfg.batch_samples, len(pieces)))
        m = trainer.sft_step(batch, None)
        if m is not None:
            losses.append(m["loss"])
        if progress is not None and (step + 1) % max(1, cfg.steps // 20) == 0:
            progress(step + 1, cfg.steps, sum(losses[-10:]) / max(1, len(losses[-10:])))
    trainer.version = 0  # a base policy: RL starts counting from here
    result: dict[str, Any] = {"samples": len(pieces), "steps": cfg.steps,
                              "final_loss": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
                              "seconds": round(time.monotonic() - t0, 1), **cloned}
    path = trainer.export(out_dir, {"pretrain": {**dataclasses.asdict(cfg), **result, "started_from": started_from},
                                    "prompt": dataclasses.asdict(prompt_cfg)})  # eval rebuilds the same prompts
    result["checkpoint"] = str(path)
    shutil.rmtree(images.root, ignore_errors=True)
    if cfg.eval_episodes:
        result["heldout"] = evaluate_base(path, cfg, model_cfg, prompt_cfg, env)
    return result


def evaluate_base(path: Path, cfg: PretrainConfig, model_cfg: Any, prompt_cfg: Any, env: Any = None) -> dict:
    """Greedy held-out success of the new base policy on the families it was cloned on."""
    from actor.engine import EngineConfig, SamplingParams
    from actor.hf_engine import HFEngine
    from launch.evaluate import evaluate, suite_tasks

    engine_cfg = EngineConfig(seed=cfg.seed, max_batch=64, device=cfg.device)
    engine = HFEngine(dataclasses.replace(model_cfg, path=str(path)),
                      engine_cfg.fitted(prompt_cfg.max_prompt_tokens, cfg.eval_max_new_tokens))
    tasks = suite_tasks(cfg.suite("heldout"), cfg.eval_episodes, env.backend if env is not None else "")
    try:
        return evaluate(engine, tasks, prompt_cfg,
                        SamplingParams(temperature=0.0, max_new_tokens=cfg.eval_max_new_tokens), cfg.eval_max_steps,
                        env=env)
    finally:
        engine.close()
