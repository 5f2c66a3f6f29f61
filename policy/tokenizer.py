"""Tokenizers behind one small interface: a byte-level one for tiny models, and Hugging Face tokenizers.

Prompts are assembled by ``actor/prompt.py``; a tokenizer encodes text pieces, names its stop tokens and, when it
has one, renders a conversation with its own chat template. Nothing is re-tokenized after sampling: sampled ids
are kept.

A Hugging Face tokenizer with a chat template (every pretrained instruct model) is used as it is: no token is
added to its vocabulary, and a turn ends at the tokens its ``generation_config.json`` (or the tokenizer) names as
end of sequence. One without a template gets our role tokens added (a model built or pretrained on them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int  # the token that ends a model turn (the one a chat template closes an assistant turn with)
    stop_ids: frozenset[int]  # every id that ends generation (eos_id among them)
    pad_id: int
    chat_template: bool  # whether prompts are rendered by the tokenizer's own chat template
    vision: Any  # a VLM's image processor (policy.vision.VisionProcessor), else None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def special(self, token: str) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; specials follow. Needs no files, so tiny test models can use it."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", *ROLE_TOKENS)
    chat_template = False
    vision = None  # a text-only policy

    def __init__(self) -> None:
        self._special = {t: 256 + i for i, t in enumerate(self.SPECIALS)}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_id = self._special["<pad>"]
        self.eos_id = self._special["<|end|>"]  # an assistant turn ends the model's output
        self.stop_ids = frozenset({self.eos_id})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def special(self, token: str) -> int:
        return self._special[token]


def generation_eos_ids(path: str | Path) -> list[int]:
    """The end-of-sequence ids a checkpoint's ``generation_config.json`` names (an int or a list), if any."""
    try:
        eos = json.loads((Path(path) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (see the module docstring for chat templates)."""

    def __init__(self, path: str | Path, model_path: str | Path = ""):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.vision = None  # set by policy.model.build_tokenizer for a VLM
        self.chat_template = bool(getattr(self.tok, "chat_template", None))
        if self.chat_template:
            # The end of a turn is what generation stops at: generation_config's eos ids (Qwen2.5-Instruct names
            # <|im_end|> and <|endoftext|>), else the tokenizer's eos; the first is the one a template closes with.
            stops = generation_eos_ids(model_path or path) or [self.tok.eos_token_id]
            if stops[0] is None:
                raise ValueError(f"tokenizer at {path}: a chat template but no eos token, and no eos_token_id in "
                                 "generation_config.json: generation could never end a turn")
            eos_text = self.tok.eos_token
            self.eos_id = (self.tok.eos_token_id if eos_text is not None and self.tok.eos_token_id in stops
                           else int(stops[0]))
            self.stop_ids = frozenset(int(s) for s in stops) | {self.eos_id}
        else:
            missing = [t for t in ROLE_TOKENS if t not in self.tok.get_vocab()]
            if missing:
                self.tok.add_special_tokens({"additional_special_tokens": missing})
            self.eos_id = self.tok.convert_tokens_to_ids("<|end|>")
            self.stop_ids = frozenset({self.eos_id})
        self.vocab_size = len(self.tok)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def special(self, token: str) -> int:
        return int(self.tok.convert_tokens_to_ids(token))

    def save_pretrained(self, directory: str | Path) -> None:
        """Its files (vocabulary, chat template) next to a checkpoint's weights: the checkpoint is a ``model.path``."""
        self.tok.save_pretrained(str(directory))
        if self.vision is not None:
            self.vision.image_processor.save_pretrained(str(directory))

    def token_text(self, token_id: int) -> str:
        """A token's text as a chat template writes it (special tokens by name)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any) -> str:
        """The conversation as the chat template writes it (text; ``actor/prompt.py`` tokenizes it in pieces)."""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **template_kwargs)


def has_tokenizer_files(path: str | Path) -> bool:
    return bool(path) and any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def resolved_kind(kind: str, path: str) -> str:
    """``auto`` made definite: ``hf`` when ``path`` holds tokenizer files, else ``byte``."""
    if kind == "auto":
        return "hf" if has_tokenizer_files(path) else "byte"
    return kind


def load_tokenizer(kind: str, path: str = "", model_path: str = "") -> Tokenizer:
    """``byte``, ``hf`` (from ``path``, a local model or tokenizer directory) or ``auto`` (see ``resolved_kind``).
    ``model_path`` is where ``generation_config.json`` is looked for."""
    kind = resolved_kind(kind, path)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise ValueError("tokenizer 'hf' needs a local path (model.path or model.tokenizer_path)")
        return HFTokenizer(path, model_path)
    raise ValueError(f"unknown tokenizer {kind!r}: auto | byte | hf")
