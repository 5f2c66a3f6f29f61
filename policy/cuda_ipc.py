"""CUDA tensors handed between processes on one GPU by IPC handle, as plain data (no pickle).

A learner and engines that share a GPU cannot form an NCCL group (NCCL refuses two ranks on one device), and
gloo moves every byte through host memory twice. CUDA IPC lets a receiver map the sender's allocation and copy
device to device. ``export`` describes a tensor with what ``torch.multiprocessing`` sends for a CUDA tensor
(``TypedStorage._share_cuda_``: the allocation's IPC handle, the storage's place in it, the producer's
reference counter and the event that orders the consumer after the producer's writes) as bytes and ints, so
the description travels in a msgpack frame rather than a pickle a peer could abuse; ``open`` rebuilds a view
with ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, on the receiver's own index of that GPU.

One ``export`` serves one receiving process (its reference count expects one consumer: a block two processes
opened under one export is never freed). The sender must keep the exported tensor alive and unchanged until
every receiver has copied out of it; the weight round's closing barrier is that guarantee
(``policy/weightsync.py``). torch is imported lazily.
"""

from __future__ import annotations

from typing import Any

import msgpack

_FIELDS = ("handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset",
           "event_handle", "event_sync_required")


def export(tensor: Any) -> dict:
    """A description of a contiguous CUDA tensor another process on the same GPU can ``open_tensor``."""
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError("only a contiguous CUDA tensor can be shared by IPC handle")
    storage = tensor.detach()._typed_storage()
    shared = storage._share_cuda_()  # (device, handle, size, offset, ref handle, ref offset, event, sync)
    desc = dict(zip(_FIELDS, shared[1:]))
    desc.update(numel=tensor.numel(), tensor_offset=tensor.storage_offset(),
                dtype=str(tensor.dtype).removeprefix("torch."))
    return desc


def open_tensor(desc: dict, device: Any) -> Any:
    """A flat view of the exported tensor, mapped into this process on ``device`` (the same physical GPU)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.device(device)
    n = int(desc["numel"])
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([n]), (1,), int(desc["tensor_offset"]), torch.storage.TypedStorage,
        getattr(torch, desc["dtype"]), device.index if device.index is not None else torch.cuda.current_device(),
        desc["handle"], desc["storage_size_bytes"], desc["storage_offset_bytes"], False,
        desc["ref_counter_handle"], desc["ref_counter_offset"], desc["event_handle"], desc["event_sync_required"])


def pack(per_member: list[list[dict]]) -> bytes:
    """One frame for a group: member ``r`` (ranks from 1) reads list ``r - 1``, its own exports."""
    return msgpack.packb(per_member, use_bin_type=True)


def unpack(data: bytes, rank: int) -> list[dict]:
    per_member = msgpack.unpackb(data, raw=False)
    if not isinstance(per_member, list) or not 1 <= rank <= len(per_member):
        raise ValueError(f"no CUDA IPC exports for member {rank}")
    descs = per_member[rank - 1]
    if not isinstance(descs, list) or not all(isinstance(d, dict) and set(_FIELDS) <= d.keys() for d in descs):
        raise ValueError("not a list of CUDA IPC tensor descriptions")
    return descs
