"""Atomic checkpoints: HF-format safetensors weights, optimizer, scheduler, RNG and trainer state.

``<run>/checkpoints/step-<version>/`` is written into a temporary sibling and renamed into place, and
``latest`` is replaced atomically after it, so a kill at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRAINER_FILE = "trainer.pt"
STATE_FILE = "state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, version: int, model: Any, optimizer: Any, scheduler: Any, state: dict, keep: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{version:08d}"
    tmp = root / f".tmp-step-{version:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}},
               tmp / TRAINER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({"version": version, **state}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).exists() else None


def load(path: Path, model: Any, optimizer: Any | None, scheduler: Any | None) -> dict:
    """Restore weights (and optimizer, scheduler, RNG when given); returns the trainer state."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights are saved once: only those may be missing.
    tied = {n for n in missing if "lm_head" in n and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    if optimizer is not None:
        blob = torch.load(path / TRAINER_FILE, weights_only=False)
        optimizer.load_state_dict(blob["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(blob["scheduler"])
        torch.set_rng_state(blob["rng"]["torch"])
        np.random.set_state(blob["rng"]["numpy"])
        random.setstate(blob["rng"]["python"])
    return json.loads((path / STATE_FILE).read_text())
