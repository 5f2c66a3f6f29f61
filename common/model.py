"""The policy model, built the same way by the actor's engine and the learner.

A model comes from a local checkpoint directory (Hugging Face format) or, for tests and the local demo,
from a small architecture config with random weights. torch and transformers are imported lazily:
``common/`` is also imported by roles that run without them (broker, env_server).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    """The policy network and its tokenizer."""

    path: str = ""
    """local checkpoint directory (HF format); empty = build a random model from the fields below"""
    tokenizer: str = "byte"
    """byte (no files needed) | hf (from path, or tokenizer_path)"""
    tokenizer_path: str = ""
    """tokenizer directory when it differs from path"""
    arch: str = "llama"
    """architecture of a config-built model: llama | qwen2"""
    hidden_size: int = 64
    """width of a config-built model"""
    num_layers: int = 2
    """transformer blocks of a config-built model"""
    num_heads: int = 4
    """attention heads of a config-built model"""
    num_kv_heads: int = 2
    """key/value heads (grouped-query attention) of a config-built model"""
    intermediate_size: int = 128
    """MLP width of a config-built model"""
    max_positions: int = 8192
    """longest sequence (prompt + output) the model accepts"""
    dtype: str = "auto"
    """float32 | bfloat16 | auto (bfloat16 on GPU, float32 on CPU)"""
    init_seed: int = 0
    """seed of a config-built model's random weights (the actor and the learner must agree)"""

    def validate(self) -> None:
        if self.tokenizer not in ("byte", "hf"):
            raise ValueError("tokenizer must be byte or hf")
        if self.arch not in ("llama", "qwen2"):
            raise ValueError("arch must be llama or qwen2")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError("dtype must be auto, float32 or bfloat16")
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError("num_heads must divide hidden_size and be a multiple of num_kv_heads")


def torch_dtype(cfg: ModelConfig, device: str) -> Any:
    import torch

    if cfg.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def build_tokenizer(cfg: ModelConfig):
    from common.tokenizer import load_tokenizer

    return load_tokenizer(cfg.tokenizer, cfg.tokenizer_path or cfg.path)


def build_model(cfg: ModelConfig, vocab_size: int, device: str = "cpu") -> Any:
    """A causal LM: loaded from ``cfg.path``, or built from the architecture fields with seeded weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # role logs are JSON lines; a progress bar on stderr is noise there
    cfg.validate()
    dtype = torch_dtype(cfg, device)
    extra = {}
    if device.startswith("cuda") and dtype != torch.float32 and importlib.util.find_spec("flash_attn") is not None:
        extra["attn_implementation"] = "flash_attention_2"  # the gpu extra; SDPA otherwise
    if cfg.path:
        if not (Path(cfg.path) / "config.json").exists():
            raise FileNotFoundError(f"model.path {cfg.path!r}: no checkpoint there (a directory with config.json and "
                                    "*.safetensors; `computerrl pretrain --out DIR` makes one)")
        model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True, dtype=dtype, **extra)
        if model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)  # role tokens added to the tokenizer
    else:
        arch_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.arch]
        hf_cfg = arch_cls(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                          num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                          num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_positions,
                          tie_word_embeddings=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, **extra)
    return model.to(device)


def sequence_logprobs(model: Any, input_ids: Any, attention_mask: Any = None, temperature: float = 1.0) -> Any:
    """Teacher-forced log-probs of each token given its prefix: ``out[:, t]`` scores ``input_ids[:, t + 1]``.

    ``temperature`` must be the sampling temperature: behaviour log-probs are recorded under it.
    """
    import torch

    position_ids = None
    if attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
