"""Tiny pretrained-model-shaped checkpoints built here, for tests, benchmarks and trying a real-model setup on a
laptop: nothing is downloaded. A checkpoint directory holds what a Hugging Face instruct model ships (config,
safetensors weights, generation_config.json, a tokenizer with its chat template), with random weights.

``chat_checkpoint``: a Qwen2-architecture chat model with a byte-level BPE tokenizer trained on sim desktop text
and a ChatML-style template (``<|im_start|>role ... <|im_end|>``) that closes turns with ``<|im_end|>``, the
token ``generation_config.json`` names first among its end-of-sequence ids, as Qwen2.5-Instruct's does.

``vlm_checkpoint``: a Qwen2-VL-architecture model, or Qwen2.5-VL's (``arch="qwen2_5_vl"``) — a two-block vision
tower, patch 14, merge 2, and a two-layer language model with multimodal RoPE —, the same kind of tokenizer with
Qwen2-VL's vision tokens
(``<|vision_start|><|image_pad|><|vision_end|>``), a ChatML template that writes them for image content parts, and
Qwen2-VL's image processor capped at ``max_pixels`` (the PIL backend: no torchvision needed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHATML_VISION_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def sim_corpus(episodes: int = 60, seed: int = 0) -> list[str]:
    """Text a desktop agent reads and writes: rules, instructions, observations and oracle actions of sim tasks
    (every family, both routes), for training a small tokenizer on."""
    from actor.demos import demonstrate
    from actor.prompt import DEFAULT_RULES
    from env_server.actions import gui_action_help
    from env_server.sim import families as sim_tasks
    from env_server.sim.backend import SimBackend

    rng = random.Random(seed)
    texts = [DEFAULT_RULES, *gui_action_help()]
    backend = SimBackend()
    for i in range(episodes):
        family = sim_tasks.FAMILY_NAMES[i % len(sim_tasks.FAMILY_NAMES)]
        _, seen = demonstrate(backend, f"sim:train:{family}/{rng.randrange(10_000)}", rng.choice(("api", "gui")))
        for obs, action in seen:
            texts += [obs.get("instruction", ""), obs.get("text", ""), action, str(obs.get("last_result", ""))]
    return [t for t in texts if t]


def train_bpe(corpus: list[str], vocab_size: int, specials: tuple[str, ...]) -> object:
    """A byte-level BPE (any text encodes; decoding gives the text back) with ``specials`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return raw


def chat_tokenizer(out: Path, specials: tuple[str, ...], template: str, vocab_size: int, corpus_episodes: int,
                   seed: int) -> object:
    """A BPE tokenizer trained on sim text, with ``template`` as its chat template and <|im_end|> as its eos, saved
    to ``out``."""
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    raw = train_bpe(sim_corpus(corpus_episodes, seed), vocab_size, specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    tok.save_pretrained(out)
    return tok


def save_seeded(out: Path, cls: type, cfg: object, seed: int, end: int, eot: int, builder: str) -> Path:
    """``cls(cfg)`` with weights seeded by ``seed``, saved to ``out`` with a generation config ending turns at
    ``end`` (then ``eot``), as an instruct checkpoint ships; returns ``out``."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[end, eot], pad_token_id=eot)
    model.save_pretrained(out)
    (out / "state.json").write_text(json.dumps({"version": 0, "built_by": f"launch.tiny_checkpoints.{builder}"}))
    return out


def chat_checkpoint(out: str | Path, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, template: str = CHATML_TEMPLATE,
                    corpus_episodes: int = 60) -> Path:
    """A tiny chat model at ``out`` (see the module docstring); returns ``out``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out)
    tok = chat_tokenizer(out, CHAT_SPECIALS, template, vocab_size, corpus_episodes, seed)
    end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=end,
                      pad_token_id=eot, bos_token_id=None)
    return save_seeded(out, Qwen2ForCausalLM, cfg, seed, end, eot, "chat_checkpoint")


def vlm_checkpoint(out: str | Path, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2,
                   vision_dim: int = 32, vision_depth: int = 2, max_pixels: int = 28 * 28 * 64, seed: int = 0,
                   corpus_episodes: int = 60, arch: str = "qwen2_vl", rope_theta: float = 1_000_000.0) -> Path:
    """A tiny vision-language model at ``out`` (see the module docstring); returns ``out``. ``arch``: qwen2_vl, or
    qwen2_5_vl (Qwen2.5-VL's vision tower: windowed attention blocks, an MLP merger; same tokens and positions).

    ``rope_theta``: the language model's rotary base (Qwen2-VL's is 1e6). Multimodal RoPE gives the temporal axis
    the highest rotary frequencies and the width axis the lowest; with this few frequencies and base 1e6 the width
    axis's fastest one turns by under 0.002 rad across a 10-token-wide screenshot, so a model this small cannot
    tell left from right. A small base (10 in ``configs/vlm-pixels.yaml``) gives both screen axes usable
    frequencies (what a policy that must click from pixels needs; docs/policies.md says what it learned)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out)
    tok = chat_tokenizer(out, CHAT_SPECIALS + VISION_SPECIALS, CHATML_VISION_TEMPLATE, vocab_size, corpus_episodes,
                         seed)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=max_pixels).save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in CHAT_SPECIALS + VISION_SPECIALS}
    end, eot = ids["<|im_end|>"], ids["<|endoftext|>"]
    head_dim = hidden_size // 4
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=end, pad_token_id=eot,
                bos_token_id=None, rope_theta=rope_theta,
                # temporal, height, width shares of the rotary half-dimension (Qwen2-VL: 16/24/24 of 64)
                rope_scaling={"type": "mrope", "mrope_section": [head_dim // 8, 3 * head_dim // 16,
                                                                 3 * head_dim // 16]})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=True)
    if arch == "qwen2_vl":
        vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        cfg, cls = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens), Qwen2VLForConditionalGeneration
    elif arch == "qwen2_5_vl":
        vision = dict(depth=vision_depth, hidden_size=vision_dim, intermediate_size=2 * vision_dim, num_heads=2,
                      out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=56, fullatt_block_indexes=[vision_depth - 1], in_channels=3)
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        cls = Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"arch must be qwen2_vl or qwen2_5_vl, not {arch!r}")
    return save_seeded(out, cls, cfg, seed, end, eot, "vlm_checkpoint")
