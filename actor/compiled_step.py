"""The HF engine's decode step compiled by ``torch.compile`` (inductor), for ``actor.engine.compile``.

A captured CUDA graph removes the launch cost of the step's kernels but not the kernels themselves: eager
PyTorch runs a model's norms, rotary embeddings and activations as many small kernels, each a pass over memory.
Inductor fuses them (a Triton kernel on a GPU, C++ on a CPU), which is what a compiled ``generate`` gains at
large batches. The compiled step is then what ``actor/decode_graphs.py`` captures, so graphs replay fused kernels.

Shapes are dynamic: one compilation serves every (rows, key columns) bucket instead of one per bucket (a
bucket's compilation of a 24-layer model takes tens of seconds). The weights are read from the module at each
call, not frozen into the compiled code, so in-place weight swaps reach it as they reach the captured graphs.

A compilation that fails (no C++ compiler on a CPU, an operation inductor cannot lower) turns compiling off for
this engine, with the reason logged once, and the step runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


class CompiledStep:
    def __init__(self, step: Callable[[int, int], Any]):
        import torch

        self.eager = step
        self.compiled = torch.compile(step, dynamic=True)
        self.disabled = ""  # why compiling is off, once a compilation failed

    def __call__(self, rows: int, columns: int) -> Any:
        if self.disabled:
            return self.eager(rows, columns)
        try:
            return self.compiled(rows, columns)
        except Exception as exc:  # an engine whose step cannot be compiled still decodes, eagerly
            self.disabled = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("compiling the decode step failed, decoding eagerly: %s", self.disabled)
            return self.eager(rows, columns)
