"""Tokenizers behind one small interface: a byte-level one for tiny models, and Hugging Face tokenizers.

Prompts are assembled from token-id segments (``actor/prompt.py``); a tokenizer only encodes text pieces and
names the special tokens that separate roles. Nothing is re-tokenized after sampling: sampled ids are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def special(self, token: str) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; specials follow. Needs no files, so tiny test models can use it."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", *ROLE_TOKENS)

    def __init__(self) -> None:
        self._special = {t: 256 + i for i, t in enumerate(self.SPECIALS)}
        self.vocab_size = 256 + len(self.SPECIALS)
        self.pad_id = self._special["<pad>"]
        self.eos_id = self._special["<|end|>"]  # an assistant turn ends the model's output

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def special(self, token: str) -> int:
        return self._special[token]


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory; role tokens are added if the vocabulary lacks them."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        missing = [t for t in ROLE_TOKENS if t not in self.tok.get_vocab()]
        if missing:
            self.tok.add_special_tokens({"additional_special_tokens": missing})
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.convert_tokens_to_ids("<|end|>")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def special(self, token: str) -> int:
        return int(self.tok.convert_tokens_to_ids(token))


def load_tokenizer(kind: str, path: str = "") -> Tokenizer:
    """``byte`` or ``hf`` (from ``path``, a local model or tokenizer directory)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise ValueError("tokenizer 'hf' needs a local path (model.path or model.tokenizer_path)")
        return HFTokenizer(path)
    raise ValueError(f"unknown tokenizer {kind!r}: byte | hf")
