"""Host values onto the model's device, and device results back to the host, without making the host wait.

``torch.tensor(values, device="cuda")`` or ``t.to("cuda")`` copies from pageable host memory, and for such a copy
torch synchronises the stream afterwards: the host waits until the GPU has run everything queued before it. An
engine's admission builds a few such tensors before and after every prefill pass, and a VLM's prefill its image inputs,
so each pass would have to finish on the GPU before the host could queue the next one. From pinned memory the copy is
queued like a kernel (``non_blocking``), and torch's pinned-memory allocator keeps the buffer until the copy has run,
so the caller may drop it at once. The other way, a ``non_blocking`` copy into host memory lands in pinned memory
torch allocates, and is complete once an event recorded after it has passed.
"""

from __future__ import annotations

from typing import Any, Sequence


def host_to_device(tensor: Any, device: Any) -> Any:
    """A host ``tensor`` on ``device``: on a GPU copied from pinned memory without waiting, elsewhere moved there."""
    import torch

    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def to_device(values: Sequence, device: Any, dtype: Any = None) -> Any:
    """``values`` as a tensor on ``device`` (``host_to_device``)."""
    import torch

    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return host_to_device(torch.tensor(values, dtype=dtype, pin_memory=True), device)


def padded_rows(rows: Sequence[Sequence[int]], width: int, fill: int, pin: bool = False) -> Any:
    """Token rows, right-padded with ``fill`` to ``width``, as one ``[len(rows), width]`` long tensor on the host
    (in pinned memory with ``pin``, to go to a GPU by ``host_to_device``)."""
    import torch

    out = torch.full((len(rows), width), fill, dtype=torch.long, pin_memory=pin)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def copy_to_host(tensor: Any) -> Any:
    """A copy of ``tensor`` in host memory: from a GPU queued without waiting (read it once an event recorded after
    this call has passed); on a CPU a plain copy, made now."""
    return tensor.to("cpu", non_blocking=True) if tensor.is_cuda else tensor.clone()
