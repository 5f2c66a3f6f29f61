"""Inference engines by ``actor.engine.kind``: ``hf`` (``actor/engine.py``) or ``vllm`` (``actor/vllm_engine.py``,
imported only when asked for: it raises a clear error where vllm is not installed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from actor.engine import Engine, EngineConfig
from actor.hf_engine import HFEngine
from policy.model import ModelConfig


def make_engine(model_cfg: ModelConfig, cfg: EngineConfig) -> Engine:
    cfg.validate()
    if cfg.kind == "hf":
        return HFEngine(model_cfg, cfg)
    from actor.vllm_engine import VLLMEngine

    return VLLMEngine(model_cfg, cfg)


def actor_engine(cfg: Any, rank: int) -> Engine:
    """The engine of a run's actor ``rank``: its sampling seed offset by the rank and the run's seed (no two actors
    sample alike), its cache fitted to the prompt and sampling limits."""
    engine_cfg = dataclasses.replace(cfg.actor.engine, seed=cfg.actor.engine.seed + 1000 * rank + cfg.run.seed)
    engine_cfg = engine_cfg.fitted(cfg.actor.prompt.max_prompt_tokens, cfg.actor.sampling.max_new_tokens)
    return make_engine(cfg.model, engine_cfg)
