"""The HF engine's decode windows captured as CUDA graphs, one per (batch rows, key columns, sampling kinds) bucket.

At the sizes an actor decodes (one token per row, a few hundred rows at most, a model under a few billion
parameters) a decode step on a GPU is bound by kernel launches, not by arithmetic: a 24-layer model issues
several hundred small kernels per token, and the sampling and bookkeeping after it a few dozen more. A graph
holds a whole window: ``sync_every`` decode steps, each followed by its sampling and the rows' bookkeeping (tokens
and log-probs into the window's buffer, positions and counts advanced). The host then issues one launch per window
and runs no Python per token.

Sampling draws from the engine's own generator, which is registered with every graph
(``CUDAGraph.register_generator_state``): a replay reads the generator's offset when it starts and advances it by
what the captured kernels draw, as the same window run eagerly would, and prefills sampling eagerly between
replays draw from it too.

A graph is captured the first time its bucket is used: two warm-up runs of one step and its sampling on a side
stream (lazy initialisations happen outside the capture; they draw from a scratch generator and write only what the
window's first step writes again), then the capture, then its replay. All graphs share one memory pool. A window reads its inputs from,
and writes its outputs to, tensors that never move (the engine's slot buffers and the KV cache), and new weights are
copied into the captured parameters in place, so a graph stays valid across weight swaps.

A capture that fails (an operation a graph cannot hold, a torch that cannot register a generator with a graph)
turns graphs off for this engine, with the reason logged once, and decoding continues eagerly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable

log = logging.getLogger(__name__)


def row_bucket(n: int, largest: int) -> int:
    """Decode batch rows in powers of two (at most ``largest``)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, largest)


def column_bucket(n: int, largest: int, step: int = 256) -> int:
    """Attended cache columns in multiples of ``step`` (at most ``largest``): fine enough that attention reads little
    beyond the longest row, coarse enough that a run captures a few dozen graphs."""
    return min(-(-n // step) * step, largest)


class DecodeGraphs:
    def __init__(self, window: Callable[..., None], warm_up: Callable[..., None], generator: Any):
        import torch

        self.torch = torch
        self.window = window  # (rows, columns, kinds): a whole decode window, from and into fixed tensors
        self.warm_up = warm_up  # the same shapes' kernels once, changing nothing the window reads
        self.generator = generator  # what the window samples from: registered with every graph
        self.graphs: dict[Hashable, Any] = {}
        self.pool: Any = None
        self.disabled = ""  # why graphs are off, once a capture failed

    def __call__(self, *key: Hashable) -> None:
        if self.disabled:
            return self.window(*key)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(key)
            except Exception as exc:  # a model whose window cannot be captured still decodes, eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("CUDA graph capture failed, decoding eagerly: %s", self.disabled)
                self.torch.cuda.synchronize()
                return self.window(*key)
        graph.replay()

    def _capture(self, key: tuple) -> Any:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside the capture
            for _ in range(2):
                self.warm_up(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if not hasattr(graph, "register_generator_state"):
            raise RuntimeError(f"torch {torch.__version__} cannot register a generator with a CUDA graph "
                               "(CUDAGraph.register_generator_state), which sampling inside the graph needs")
        graph.register_generator_state(self.generator)  # before the capture begins: its offsets are the graph's
        # thread_local: the actor's weights thread may touch CUDA meanwhile; that must not void this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.window(*key)
        self.pool = graph.pool()
        self.graphs[key] = graph
        return graph
