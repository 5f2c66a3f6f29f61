"""Inference engines by ``actor.engine.kind``: ``hf`` (``actor/engine.py``) or ``vllm`` (``actor/vllm_engine.py``,
imported only when asked for: it raises a clear error where vllm is not installed)."""

from __future__ import annotations

from actor.engine import Engine, EngineConfig
from actor.hf_engine import HFEngine
from common.model import ModelConfig


def make_engine(model_cfg: ModelConfig, cfg: EngineConfig) -> Engine:
    cfg.validate()
    if cfg.kind == "hf":
        return HFEngine(model_cfg, cfg)
    from actor.vllm_engine import VLLMEngine

    return VLLMEngine(model_cfg, cfg)
