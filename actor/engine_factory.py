"""Inference engines by ``actor.engine.kind``: ``hf`` (``actor/engine.py``) or ``vllm`` (``actor/vllm_engine.py``,
imported only when asked for: it raises a clear error where vllm is not installed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from actor.engine import Engine, EngineConfig
from actor.hf_engine import HFEngine
from policy.model import ModelConfig
from policy.saved import checkpoint_version, saved_model_config

CROSS_POLICY_SEED = 500_000
"""added to the sampling seed of an actor's cross-policy engine, so it does not draw what its main engine draws"""


def make_engine(model_cfg: ModelConfig, cfg: EngineConfig) -> Engine:
    cfg.validate()
    if cfg.kind == "hf":
        return HFEngine(model_cfg, cfg)
    from actor.vllm_engine import VLLMEngine

    return VLLMEngine(model_cfg, cfg)


def _engine_config(cfg: Any, rank: int, seed_offset: int = 0) -> EngineConfig:
    """Actor ``rank``'s engine settings: its sampling seed offset by the rank and the run's seed (no two actors
    sample alike), its cache fitted to the prompt and sampling limits."""
    seed = cfg.actor.engine.seed + 1000 * rank + cfg.run.seed + seed_offset
    return dataclasses.replace(cfg.actor.engine, seed=seed).fitted(cfg.actor.prompt.max_prompt_tokens,
                                                                   cfg.actor.sampling.max_new_tokens)


def actor_engine(cfg: Any, rank: int) -> Engine:
    """The engine of a run's actor ``rank``."""
    return make_engine(cfg.model, _engine_config(cfg, rank))


def cross_policy_engine(cfg: Any, rank: int) -> Engine | None:
    """The engine that plays the rollouts a ticket gives to cross-policy sampling (``actor.cross_policy``), or None.
    It never takes weight rounds: its tokens carry the version its weights were saved at (0 for the run's initial
    policy), and the group names their slots, so the staleness bound keeps to the current policy's rollouts."""
    source = cfg.actor.cross_policy
    if not source:
        return None
    if source == "initial":
        model_cfg, version = cfg.model, 0
    else:
        model_cfg, version = saved_model_config(source, cfg.model), checkpoint_version(source) or 0
    engine = make_engine(model_cfg, _engine_config(cfg, rank, CROSS_POLICY_SEED))
    engine.relabel(version)
    return engine
