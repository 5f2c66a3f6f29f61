"""The policy model, built the same way by the actor's engine and the learner.

A model comes from a local checkpoint directory (Hugging Face format) or, for tests and the local demo,
from a small architecture config with random weights. torch and transformers are imported lazily:
``common/`` is also imported by roles that run without them (broker, env_server).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator


@dataclass
class ModelConfig:
    """The policy network and its tokenizer."""

    path: str = ""
    """local checkpoint directory (HF format); empty = build a random model from the fields below"""
    kind: str = "auto"
    """auto (vlm when the checkpoint has a vision tower) | causal (text in, text out) | vlm (screenshots in)"""
    min_pixels: int = 0
    """a VLM's smallest image area in pixels after resizing (0 = the checkpoint's image processor's)"""
    max_pixels: int = 0
    """a VLM's largest image area in pixels after resizing (0 = the checkpoint's; fewer = fewer image tokens)"""
    train_vision: bool = True
    """training updates a VLM's vision tower (with its merger); false: frozen, only the language model learns"""
    image_workers: int = 4
    """threads that turn a VLM's screenshots into model inputs ahead of use (0: on the thread that needs them)"""
    tokenizer: str = "auto"
    """auto (hf when the checkpoint has tokenizer files, else byte) | byte (no files needed) | hf"""
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
    vocab_size: int = 0
    """embedding rows of a config-built model (0 = the tokenizer's; larger = a real model's shape, e.g. 151936)"""
    dtype: str = "auto"
    """float32 | bfloat16 | auto (bfloat16 on GPU, float32 on CPU)"""
    init_seed: int = 0
    """seed of a config-built model's random weights (the actor and the learner must agree)"""

    def validate(self) -> None:
        if self.kind not in ("auto", "causal", "vlm"):
            raise ValueError("model.kind must be auto, causal or vlm")
        if self.kind == "vlm" and not self.path:
            raise ValueError("model.kind vlm needs model.path (a checkpoint with its image processor; "
                             "launch.tiny_checkpoints.vlm_checkpoint builds a tiny one)")
        if self.min_pixels < 0 or self.max_pixels < 0 or (self.max_pixels and self.min_pixels > self.max_pixels):
            raise ValueError("model.min_pixels and max_pixels must be >= 0 and min <= max")
        if self.image_workers < 0:
            raise ValueError("model.image_workers must be >= 0 (0: images are processed where they are needed)")
        if self.tokenizer not in ("auto", "byte", "hf"):
            raise ValueError("tokenizer must be auto, byte or hf")
        if self.arch not in ("llama", "qwen2"):
            raise ValueError("arch must be llama or qwen2")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError("dtype must be auto, float32 or bfloat16")
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise ValueError("num_heads must divide hidden_size and be a multiple of num_kv_heads")
        if self.vocab_size < 0:
            raise ValueError("model.vocab_size must be >= 0 (0 = the tokenizer's)")

    def check_files(self, checkpoint: bool = True) -> None:
        """The checkpoint (unless not ``checkpoint``: the tokenizer alone is loaded) and tokenizer this config names
        are on disk (ConfigError naming the key if not). Apart from ``validate``: a config may name a policy about to
        be made (``computerrl pretrain --out``), so this runs where they are loaded, and before a run starts any
        role."""
        from common.config import ConfigError
        from policy.tokenizer import TOKENIZER_FILES, has_tokenizer_files

        if checkpoint and self.path and not (Path(self.path) / "config.json").is_file():
            raise ConfigError(f"model.path {self.path!r}: no checkpoint there (a directory with config.json and "
                              "*.safetensors; `computerrl pretrain --out DIR` makes one)")
        if checkpoint and self.path:
            from policy.weight_files import weights_damage

            damaged = weights_damage(self.path)  # every role would crash loading it, at each of its restarts
            if damaged:
                raise ConfigError(f"model.path {self.path!r}: its weights are damaged: {damaged}")
        # auto takes the byte tokenizer where it finds no files: a mistyped tokenizer_path must not mean that
        if self.tokenizer_path and not has_tokenizer_files(self.tokenizer_path):
            raise ConfigError(f"model.tokenizer_path {self.tokenizer_path!r}: no tokenizer there (none of "
                              f"{', '.join(TOKENIZER_FILES)})")
        if self.tokenizer == "hf" and not has_tokenizer_files(self.tokenizer_path or self.path):
            raise ConfigError("model.tokenizer is hf, and neither model.tokenizer_path nor model.path holds "
                              "tokenizer files")


def torch_dtype(cfg: ModelConfig, device: str) -> Any:
    import torch

    if cfg.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def model_kind(cfg: ModelConfig) -> str:
    """``causal`` or ``vlm``: ``auto`` is vlm when the checkpoint's config has a vision tower."""
    if cfg.kind != "auto":
        return cfg.kind
    if not cfg.path:
        return "causal"
    try:
        config = json.loads((Path(cfg.path) / "config.json").read_text())
    except (OSError, ValueError):
        return "causal"  # build_model says what is wrong with the directory
    return "vlm" if "vision_config" in config else "causal"


def build_tokenizer(cfg: ModelConfig):
    """The policy's tokenizer; a VLM's also carries its image processor (``.vision``), as a HF processor would."""
    from policy.tokenizer import ByteTokenizer, load_tokenizer

    cfg.check_files(checkpoint=False)
    tok = load_tokenizer(cfg.tokenizer, cfg.tokenizer_path or cfg.path, cfg.path)
    if model_kind(cfg) == "vlm":
        from policy.vision import VisionProcessor

        if isinstance(tok, ByteTokenizer):
            raise ValueError("model.tokenizer is byte, and a vision-language model reads its own tokenizer: set "
                             "model.tokenizer to auto (or hf)")
        if not tok.chat_template:
            raise ValueError(f"model.kind vlm: the tokenizer at {cfg.tokenizer_path or cfg.path} has no chat template "
                             "(images enter prompts through the template's image placeholders)")
        tok.vision = VisionProcessor(cfg.path, cfg.min_pixels, cfg.max_pixels, workers=cfg.image_workers)
    return tok


def attention_implementation(device: str, dtype: Any) -> str:
    """flash_attention_2 where the ``gpu`` extra's flash-attn loads, else PyTorch's SDPA.

    ``find_spec`` is not enough: a flash-attn wheel built for another torch ABI is found, then fails with an
    undefined symbol when its CUDA extension loads, i.e. at model build. Importing it here catches that."""
    import torch

    if not device.startswith("cuda") or dtype == torch.float32 or importlib.util.find_spec("flash_attn") is None:
        return "sdpa"
    try:
        import flash_attn  # noqa: F401  (loads flash_attn_2_cuda, the compiled part)
    except Exception as exc:  # ImportError/OSError from a mismatched build: fall back, say why once
        warnings.warn(f"flash-attn is installed but does not load ({type(exc).__name__}: {exc}); using SDPA. "
                      "Reinstall it for this torch: pip install flash-attn --no-build-isolation", stacklevel=2)
        return "sdpa"
    return "flash_attention_2"


def cache_keyword(forward: Any) -> str:
    """The keyword a transformers model's ``forward`` (and so its ``generate``) takes a KV cache by: ``cache`` since
    transformers 5.x, ``past_key_values`` before (5.x still accepts it, with a deprecation warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def build_model(cfg: ModelConfig, vocab_size: int, device: str = "cpu", dtype: Any = None,
                keep_on_cpu: bool = False, meta: bool = False) -> Any:
    """A causal LM: loaded from ``cfg.path``, or built from the architecture fields with seeded weights.

    ``dtype`` overrides the configured one (the learner keeps float32 master weights and computes in
    ``torch_dtype(cfg, device)``); attention is chosen for the compute dtype either way. ``keep_on_cpu``:
    built for ``device`` but left in host memory (FSDP2 then moves only each rank's shard to the GPU). ``meta``:
    the same modules on the meta device, shapes without memory or values (a learner rank whose shards come from
    rank 0).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # role logs are JSON lines; a progress bar on stderr is noise there
    cfg.validate()
    compute = torch_dtype(cfg, device)
    dtype = dtype or compute
    extra = {"attn_implementation": attention_implementation(device, compute)}
    if cfg.path:
        cfg.check_files()
        auto = AutoModelForImageTextToText if model_kind(cfg) == "vlm" else AutoModelForCausalLM
        if meta:
            from transformers import AutoConfig

            with torch.device("meta"):
                model = auto.from_config(AutoConfig.from_pretrained(cfg.path, local_files_only=True), dtype=dtype,
                                         **extra)
        else:
            model = auto.from_pretrained(cfg.path, local_files_only=True, dtype=dtype, **extra)
        if model.get_input_embeddings().num_embeddings < vocab_size:  # role tokens added to the tokenizer
            if meta:  # (the new rows' values come with the rest: no mean of the old ones to take, on no values)
                with torch.device("meta"):
                    model.resize_token_embeddings(vocab_size, mean_resizing=False)
            else:
                model.resize_token_embeddings(vocab_size)
    elif meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_arch_config(cfg, vocab_size), dtype=dtype, **extra)
        return model
    else:
        # drawn in float32 whatever the dtype, then rounded: the learner's float32 masters and an engine's bf16
        # copy are the same version-0 weights (an init drawn in bf16 need not be their rounding)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            model = AutoModelForCausalLM.from_config(_arch_config(cfg, vocab_size), dtype=torch.float32, **extra)
        model = model.to(dtype)
    return model if keep_on_cpu or meta else model.to(device)


def _arch_config(cfg: ModelConfig, vocab_size: int) -> Any:
    """The transformers config of a model built from the architecture fields (no ``model.path``)."""
    from transformers import LlamaConfig, Qwen2Config

    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    arch_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[cfg.arch]
    return arch_cls(vocab_size=cfg.vocab_size or vocab_size, hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                    num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                    max_position_embeddings=cfg.max_positions, tie_word_embeddings=True)


def parameter_layout(cfg: ModelConfig, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the parameters ``build_model`` would make (what a weight round carries), from the
    config alone: no weight is read or allocated. (``from_pretrained`` cannot run on the meta device: transformers
    >= 4.53 refuses it, so an engine that holds no HF model of its own builds the skeleton from its config.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg.validate()
    if cfg.path:
        hf_cfg = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        auto = AutoModelForImageTextToText if model_kind(cfg) == "vlm" else AutoModelForCausalLM
    else:
        hf_cfg, auto = _arch_config(cfg, vocab_size), AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_cfg)
    # build_model grows the embeddings (and an untied head) to the tokenizer's size when it has more tokens
    rows = model.get_input_embeddings().num_embeddings
    grown = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return [(n, (vocab_size, *p.shape[1:]) if id(p) in grown and rows < vocab_size else tuple(p.shape))
            for n, p in model.named_parameters()]


def freeze_vision(model: Any) -> None:
    """Stop training a VLM's vision tower and merger (``model.visual`` in transformers' Qwen2-VL family): no
    gradient reaches them, so the optimizer leaves them as loaded.

    Why a user wants it: fine-tuning a pretrained VLM often keeps its vision encoder fixed (cheaper, and the encoder
    already sees well). Why a tiny VLM trained from scratch needs it: measured on the pixel-only sim family, training
    the random tower with the language model collapses its features within the first ~50 steps, after which the
    model could not tell 6 screenshots apart; frozen, its random features separate them in ~100 steps."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None:
        raise ValueError("model.train_vision false: the model has no vision tower (model.visual)")
    for p in visual.parameters():
        p.requires_grad_(False)


BANNED_LOGIT = -1e9  # a column no token may be sampled from: exp() is 0 in float32, and no inf makes a NaN


def ban(logits: Any, banned: Any) -> Any:
    """``logits`` with the ``banned`` columns (a LongTensor, may be None) set to ``BANNED_LOGIT``; out of place."""
    if banned is None or not len(banned):
        return logits
    return logits.index_fill(-1, banned.to(logits.device), BANNED_LOGIT)


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any = None, temperature: float = 1.0,
                   vocab: int = 0, vision: dict | None = None, banned: Any = None,
                   scored: Any = None, shared: SharedPrompt | None = None) -> tuple[Any, Any]:
    """Teacher-forced log-probs of each token given its prefix, and the (float, tempered) logits they came
    from: ``lp[:, t]`` scores ``input_ids[:, t + 1]``.

    ``temperature`` must be the sampling temperature: behaviour log-probs are recorded under it. ``vocab``
    (the tokenizer's size) drops embedding rows no token maps to (real checkpoints pad their vocabulary:
    Qwen2.5 has 151,936 rows for 151,665 tokens); engines sample over the same ``vocab`` columns, without the
    ``banned`` ones (a VLM's image placeholders). ``vision``: a VLM's image inputs and multimodal positions
    (``policy.vision.VisionProcessor.model_inputs``).

    ``scored`` (int64 ``[M]``, optional): the only positions whose log-probs are wanted, as flat indices into the
    ``[N, L - 1]`` grid of ``lp``, ascending. The output head then runs on those positions alone (``head_reads``),
    so the rest of each row costs neither the head's matmul nor the full-vocabulary float32 logits and their
    gradient. In RL they are the sampled tokens, a small part of a row that is mostly prompt (an instruction and a
    screen's text or image tokens, then a short action). ``lp`` is 0 elsewhere, and the logits returned are
    ``[M, V]``: the scored positions, in that order. Indices, not a boolean mask: selecting by a mask makes the host
    wait for the device to count it.

    ``shared`` (with ``scored``, unmasked right-padded rows): every row begins with the same prompt (a VLM's: with the
    same images), which is then run once rather than once a row (``shared_prompt_logits``). The log-probs and their
    gradients are those of the rows run whole.
    """
    import torch

    if vision is not None:
        extra = vision
    elif attention_mask is not None:
        extra = {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}
    else:
        extra = {}
    targets = input_ids[:, 1:]
    if scored is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits[:, :-1]
    else:
        # grid position r * (L - 1) + c is the hidden state at r * L + c, whose target is the token after it
        at = scored + torch.div(scored, input_ids.shape[1] - 1, rounding_mode="floor")
        if shared is not None:
            if attention_mask is not None:
                raise ValueError("a shared prompt is scored on unmasked, right-padded rows only")
            logits = shared_prompt_logits(model, input_ids, shared, vision)
        else:
            with head_reads(model, lambda hidden: hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)):
                logits = model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
        targets = input_ids.reshape(-1).index_select(0, at + 1)
    logits = logits[..., :vocab or None].float()
    if temperature != 1.0:  # one full-vocabulary copy fewer in the common case
        logits = logits / temperature
    logits = ban(logits, banned)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    if scored is not None:
        n, width = input_ids.shape
        lp = lp.new_zeros(n * (width - 1)).index_copy(0, scored, lp).view(n, width - 1)
    return lp, logits


@dataclass
class SharedPrompt:
    """Rows that all begin with one prompt (a GRPO group's first turns), to be scored with one pass over it."""

    length: int
    """the prompt's tokens, the same at the start of every row"""
    index: Any
    """int64 [M], one per scored position in ``scored``'s order: its row in [the prompt's last hidden state; the
    continuations' hidden states, row-major] (0 scores a row's first sampled token, which the prompt's last
    position predicts)"""
    vision: dict | None = None
    """a VLM's inputs for the prompt's own pass: its one row's images and positions (``model_inputs``)"""


def shared_prompt_logits(model: Any, input_ids: Any, shared: SharedPrompt, vision: dict | None = None) -> Any:
    """The output head's logits at ``shared.index`` for right-padded rows that all begin with the same
    ``shared.length`` tokens: one pass over that prompt as one row, its keys and values repeated for every row (a
    KV cache, as in generation), then one pass over all the rows' continuations, which attend to them.

    Causal attention makes this exact: a prompt token never sees what follows it, so its hidden states, keys and
    values are the same in every row, and each continuation sees the prompt and its own earlier tokens as it would
    in its row. Gradients reach the prompt's pass from every row through the repeated keys and values (the repeat's
    backward sums them). So a group of G rollouts pays for its prompt once instead of G times. The model's own
    forward runs both passes (FSDP2's hooks included); activation checkpointing drops a layer's cache in training,
    so the trainer does not share prompts under it.

    ``vision``: a VLM's inputs for all the rows (``token_logprobs``). The prompt's pass takes ``shared.vision``, its
    own (the vision tower runs once); the rows' pass, the rows' multimodal positions past the prompt."""
    import torch

    rows, length = input_ids.shape[0], shared.length
    keyword = cache_keyword(getattr(model, "module", model).forward)
    first = shared.vision or {}
    rest = {"position_ids": vision["position_ids"][:, :, length:]} if vision is not None else {}
    if (vision is None) != (shared.vision is None):
        raise ValueError("a VLM's shared prompt needs its own inputs (SharedPrompt.vision) and the rows' positions")
    last: list[Any] = []

    def keep_last(hidden: Any) -> Any:  # the prompt's last hidden state; the head's [1, V] of it is not used
        last.append(hidden[:, -1])
        return last[0]

    with head_reads(model, keep_last):
        prompt_pass = model(input_ids=input_ids[:1, :length], use_cache=True, **first)
    cache = getattr(prompt_pass, keyword)
    cache.batch_repeat_interleave(rows)
    with head_reads(model, lambda hidden: torch.cat([last[0], hidden.reshape(-1, hidden.shape[-1])])
                    .index_select(0, shared.index)):
        return model(input_ids=input_ids[:, length:], use_cache=True, **{keyword: cache}, **rest).logits


@contextlib.contextmanager
def head_reads(model: Any, select: Callable[[Any], Any]) -> Iterator[None]:
    """While open, ``model``'s output head (``get_output_embeddings``; ``model.module``'s for a wrapper) reads
    ``select(hidden states)`` instead of all of them.

    A hook on the head's input rather than a forward of ``model.model`` and then the head: the model's own forward
    still runs whole, so whatever wraps it (FSDP2's unsharding of the root's parameters, the head's among them)
    runs as it always does."""
    inner = getattr(model, "module", model)
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output head (get_output_embeddings) to score positions with")
    handle = head.register_forward_pre_hook(lambda _module, args: (select(args[0]), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def sequence_logprobs(model: Any, input_ids: Any, attention_mask: Any = None, temperature: float = 1.0,
                      vocab: int = 0, vision: dict | None = None, banned: Any = None) -> Any:
    """``token_logprobs`` without the logits."""
    return token_logprobs(model, input_ids, attention_mask, temperature, vocab, vision, banned)[0]
