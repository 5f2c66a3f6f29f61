"""Float32 master weights with low-precision compute on one learner rank.

Pure bf16 training (bf16 parameters and AdamW state) loses most updates at fine-tuning learning rates: a
step of 1e-6 x a weight of order 1e-2 is far below bf16's resolution (8 bits of mantissa). The standard fix
keeps float32 masters for the optimizer and runs forward/backward on a bf16 copy. With several ranks FSDP2's
``MixedPrecisionPolicy`` does exactly this (``learner.distributed.shard_model``); on one rank this twin does.

The twin is a second module whose parameters are the masters cast to the compute dtype. After backward its
gradients move into the masters' ``.grad`` (as float32); after the optimizer step the masters are cast back.
Both copies cost a pass over the parameters, small next to a step's forward and backward.

``compute_model`` picks what the passes run on; the trainer calls the same two hooks either way.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class LowPrecisionTwin:
    """A compute-dtype copy of ``master`` that forward/backward run on; the optimizer keeps ``master``."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.module = copy.deepcopy(master).to(dtype)
        self._pairs = list(zip(self.module.parameters(), master.parameters()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_parameters())

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Move this step's gradients to the masters (float32), freeing the low-precision ones."""
        for low, master in self._pairs:
            if low.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = low.grad.to(master.dtype)
            else:
                master.grad.copy_(low.grad)
            low.grad = None

    @torch.no_grad()
    def master_to_compute(self) -> None:
        """Cast the masters' current values into the compute copy (after an optimizer step or a load)."""
        for low, master in self._pairs:
            low.copy_(master)


class SameModel:
    """The passes run on the masters themselves (float32 compute, or FSDP2 casting per unit): no copies."""

    def __init__(self, master: torch.nn.Module):
        self.module = master

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_parameters())

    def grads_to_master(self) -> None:
        """Nothing to move: the masters already hold the gradients."""

    def master_to_compute(self) -> None:
        """Nothing to cast: the passes read the masters."""


def compute_model(master: torch.nn.Module, dtype: torch.dtype, sharded: bool) -> LowPrecisionTwin | SameModel:
    """What forward/backward run on: a low-precision twin on one rank, the masters otherwise."""
    if dtype == torch.float32 or sharded:
        return SameModel(master)
    return LowPrecisionTwin(master, dtype)
