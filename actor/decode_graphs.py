"""The HF engine's decode step captured as CUDA graphs, one per (batch rows, key columns) bucket.

At the sizes an actor decodes (one token per row, a few hundred rows at most, a model under a few billion
parameters) a decode step on a GPU is bound by kernel launches, not by arithmetic: a 24-layer model issues
several hundred small kernels per token. A CUDA graph replays all of them with one launch. A graph is
captured the first time its bucket is used (two warm-up runs on a side stream, then the capture) and
replayed from then on; all graphs share one memory pool. The step reads its inputs from, and writes its
logits to, tensors that never move (the engine's slot buffers and the KV cache), and new weights are copied
into the captured parameters in place, so a graph stays valid across weight swaps.

A capture that fails (an operation a graph cannot hold) turns graphs off for this engine, with the reason
logged once, and decoding continues eagerly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

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
    def __init__(self, step: Callable[[int, int], Any]):
        import torch

        self.torch = torch
        self.step = step  # (rows, key columns) -> logits; reads and writes only fixed tensors
        self.graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.pool: Any = None
        self.disabled = ""  # why graphs are off, once a capture failed

    def __call__(self, rows: int, columns: int) -> Any:
        if self.disabled:
            return self.step(rows, columns)
        entry = self.graphs.get((rows, columns))
        if entry is None:
            try:
                entry = self._capture(rows, columns)
            except Exception as exc:  # a model whose step cannot be captured still decodes, eagerly
                self.disabled = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("CUDA graph capture failed, decoding eagerly: %s", self.disabled)
                self.torch.cuda.synchronize()
                return self.step(rows, columns)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, rows: int, columns: int) -> tuple[Any, Any]:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside the capture
            for _ in range(2):
                self.step(rows, columns)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the actor's weights thread may touch CUDA meanwhile; that must not void this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self.step(rows, columns)
        self.pool = graph.pool()
        self.graphs[(rows, columns)] = (graph, logits)
        return graph, logits
