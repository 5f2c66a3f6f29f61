"""Tiny pretrained-model-shaped checkpoints built here, for tests, benchmarks and trying a real-model setup on a
laptop: nothing is downloaded. A checkpoint directory holds what a Hugging Face instruct model ships (config,
safetensors weights, generation_config.json, a tokenizer with its chat template), with random weights.

``chat_checkpoint``: a Qwen2-architecture chat model with a byte-level BPE tokenizer trained on sim desktop text
and a ChatML-style template (``<|im_start|>role ... <|im_end|>``) that closes turns with ``<|im_end|>``, the
token ``generation_config.json`` names first among its end-of-sequence ids, as Qwen2.5-Instruct's does.
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


def sim_corpus(episodes: int = 60, seed: int = 0) -> list[str]:
    """Text a desktop agent reads and writes: rules, instructions, observations and oracle actions of sim tasks
    (every family, both routes), for training a small tokenizer on."""
    from actor.demos import demonstrate
    from actor.prompt import DEFAULT_RULES
    from env_server.actions import gui_action_help
    from env_server.sim import tasks as sim_tasks
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


def chat_checkpoint(out: str | Path, vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, template: str = CHATML_TEMPLATE,
                    corpus_episodes: int = 60) -> Path:
    """A tiny chat model at ``out`` (see the module docstring); returns ``out``."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = train_bpe(sim_corpus(corpus_episodes, seed), vocab_size, CHAT_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    tok.save_pretrained(out)
    end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=end,
                      pad_token_id=eot, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[end, eot], pad_token_id=eot)
    model.save_pretrained(out)
    (out / "state.json").write_text(json.dumps({"version": 0, "built_by": "launch.tiny_checkpoints.chat_checkpoint"}))
    return out
