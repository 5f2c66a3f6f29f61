"""The HF engine's forward passes compiled by ``torch.compile`` (inductor), for ``actor.engine.compile``: the decode
step and, for a text model, the prefill pass.

A captured CUDA graph removes the launch cost of a step's kernels but not the kernels themselves: eager
PyTorch runs a model's norms, rotary embeddings and activations as many small kernels, each a pass over memory.
Inductor fuses them (a Triton kernel on a GPU, C++ on a CPU), which is what a compiled ``generate`` gains at
large batches. The compiled decode step is then what ``actor/decode_graphs.py`` captures, so graphs replay fused
kernels. A prefill pass is not captured (its rows, tokens and columns differ every time), so there compiling also
cuts what the host does per pass: one call into generated code instead of some sixty Python-dispatched operators a
layer.

Shapes are dynamic: one compilation serves every shape instead of one per shape (a compilation of a 24-layer
model takes tens of seconds). The weights are read from the module at each call, not frozen into the compiled
code, so in-place weight swaps reach it as they reach the captured graphs.

A compilation that fails (no C++ compiler on a CPU, an operation inductor cannot lower) turns compiling off for
that function, with the reason logged once, and it runs eagerly from then on.

Before anything compiles, autograd starts its device threads (``start_autograd_threads``): under torch 2.11, the lent
GPU machines' version, a process whose first backward came after inductor had compiled on another thread segfaulted
as autograd started them (``Engine::start_device_threads``), which a learner beside an engine in one process (the
in-process tier, a test session) would do. Found on a CPU by ``launch/gpu-rehearsal.sh``; torch 2.13 does not.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


@functools.cache
def start_autograd_threads() -> None:
    """One backward of one element, once per process: autograd starts its device threads now, not later in a
    process where inductor has compiled on another thread (the torch 2.11 segfault above)."""
    import torch

    with torch.inference_mode(False), torch.enable_grad():
        weight = torch.zeros(1, requires_grad=True)
        (weight * 2).sum().backward()


class Compiled:
    def __init__(self, fn: Callable[..., Any], what: str):
        import torch

        start_autograd_threads()
        self.eager, self.what = fn, what
        self.compiled = torch.compile(fn, dynamic=True)
        self.disabled = ""  # why compiling is off, once a compilation failed

    def __call__(self, *args: Any) -> Any:
        if self.disabled:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except Exception as exc:  # an engine whose pass cannot be compiled still runs it, eagerly
            self.disabled = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("compiling %s failed, running it eagerly: %s", self.what, self.disabled)
            return self.eager(*args)
