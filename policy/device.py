"""The torch device a config names (``cpu``, ``cuda``, ``cuda:N``), checked against the process that will use it.

A device that is not there fails the same way every time: checked where a role starts (and by ``computerrl run``
before it starts any), it is a configuration error naming the key, not a crash its supervisor restarts."""

from __future__ import annotations

import os

from common.config import ConfigError


def check_device(key: str, device: str) -> None:
    """ConfigError unless this process can compute on ``device``. torch is imported only for a non-CPU device, and
    torch counts GPUs through NVML where it can, leaving CUDA uninitialised (an engine may still fork workers)."""
    if device == "cpu":
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"{key}={device!r}: not a device (cpu, cuda or cuda:N): {exc}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ConfigError(f"{key}={device!r}: cpu, cuda or cuda:N")
    if not torch.backends.cuda.is_built():
        raise ConfigError(f"{key}={device}: this torch ({torch.__version__}) is built without CUDA; install a CUDA "
                          f"build of torch on this machine, or set {key}=cpu")
    visible = torch.cuda.device_count()
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if where is None else repr(where)
    if visible == 0:
        raise ConfigError(f"{key}={device}: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES {shown}); "
                          f"run it where one is, or set {key}=cpu")
    if dev.index is not None and dev.index >= visible:
        raise ConfigError(f"{key}={device}: {visible} CUDA GPU(s) visible to this process (CUDA_VISIBLE_DEVICES "
                          f"{shown}), so indices 0..{visible - 1}")
