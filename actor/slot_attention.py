"""Attention for the HF engine's decode steps: one query token per row over a slot of the KV cache, with
grouped-query heads read once.

A decode step attends one new token per row over up to a few thousand cached columns, under a mask (rows have
different lengths; the engine's is additive, built once per step), so PyTorch's flash kernels, which take no mask,
are out, and transformers' SDPA path then repeats every key/value head for each query head of its group before
attending (7 copies of the whole cache per layer for Qwen2.5-0.5B's 14 query and 2 key/value heads). Here the query
heads of a group are laid side by side instead: one batched matmul per group reads each cached key and value once.
Prefill (many query tokens per row) stays on SDPA: under the engine's mask, or with none and causal for a pass whose
prompts all start at column 0.

Registered with transformers' ``AttentionInterface`` under ``ATTENTION`` and set on the engine's own model only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

ATTENTION = "computerrl_slot_decode"
LIBRARY_ATTENTION = "sdpa"  # what transformers runs these models with by default


def slot_decode_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """``query`` [rows, heads, q, dim], ``key``/``value`` [rows, kv_heads, columns, dim], ``attention_mask``
    [rows, 1, q, columns] (additive: 0 = attend, a large negative value = not); returns [rows, q, heads, dim] as
    transformers' functions do."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, q, dim = query.shape
    if q != 1 or attention_mask is None or attention_mask.dtype == torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # query head h serves kv head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * (scaling or dim ** -0.5)
    scores = scores + attention_mask  # [rows, 1, 1, columns] broadcasts over heads
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)  # [rows, kv_heads, group, dim]
    return out.reshape(rows, 1, heads, dim), None


def use_slot_decode_attention(model: Any) -> bool:
    """Route ``model``'s attention through ``slot_decode_attention`` (its prefills still reach SDPA); False where
    this transformers cannot set a custom implementation on one model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, slot_decode_attention)
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, AttributeError, KeyError):
        return False
    return model.config._attn_implementation == ATTENTION


@contextlib.contextmanager
def library_attention(model: Any) -> Iterator[Any]:
    """``model`` (an engine's) on transformers' own attention meanwhile, as a user runs it without our engine: what a
    benchmark's baseline (``generate``, transformers' continuous batching) must run on. On ours, transformers builds
    no mask from a 2D ``attention_mask`` at all (it makes masks only for attention it knows), so ``generate`` would
    attend over padding and unwritten cache columns."""
    attention = model.config._attn_implementation
    model.set_attn_implementation(LIBRARY_ATTENTION)
    try:
        yield model
    finally:
        model.set_attn_implementation(attention)
