"""Small host values (slot numbers, lengths, sampling settings) onto the engine's device without a wait.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and for such a copy torch synchronises the
stream afterwards: the host waits until the GPU has run everything queued before it. An admission builds a few such
tensors before and after every prefill pass, so each pass would have to finish on the GPU before the host could
queue the next one. From pinned memory the copy is queued like a kernel (``non_blocking``), and torch's pinned-memory
allocator keeps the buffer until the copy has run, so the caller may drop it at once.
"""

from __future__ import annotations

from typing import Any, Sequence


def to_device(values: Sequence, device: Any, dtype: Any = None) -> Any:
    """``values`` as a tensor on ``device``: on a GPU copied from pinned memory without waiting, elsewhere built
    there."""
    import torch

    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def rows_to_device(rows: Sequence[Sequence[int]], width: int, fill: int, device: Any) -> Any:
    """Token rows, right-padded with ``fill`` to ``width``, as one ``[len(rows), width]`` long tensor on
    ``device`` (one copy, as ``to_device``)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    out = torch.full((len(rows), width), fill, dtype=torch.long, pin_memory=cuda)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out.to(device, non_blocking=True) if cuda else out
