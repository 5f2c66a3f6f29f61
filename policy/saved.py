"""A saved policy on disk, as the actor, evaluation and the launch commands find it: a learner checkpoint
(``<run>/checkpoints/step-N``, its ``state.json`` naming version and model), a run's ``checkpoints/`` folder (its
newest), or a ``computerrl pretrain`` export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from policy.model import ModelConfig


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A checkpoint directory; a run's checkpoints/ directory means its newest."""
    ck = Path(checkpoint)
    if (ck / "latest").exists():
        ck = ck / (ck / "latest").read_text().strip()
    return ck


def _state(ck: Path) -> dict[str, Any]:
    try:
        return json.loads((ck / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def is_saved_policy(checkpoint: str | Path) -> bool:
    """A directory a model loads from: its Hugging Face config is there."""
    return (resolve_checkpoint(checkpoint) / "config.json").is_file()


def checkpoint_version(checkpoint: str | Path) -> int | None:
    """The policy version a checkpoint holds: its ``state.json``'s, else the N of a ``step-N`` directory."""
    ck = resolve_checkpoint(checkpoint)
    try:
        return int(_state(ck)["version"])
    except (KeyError, TypeError, ValueError):
        tail = ck.name.rpartition("-")[2]
        return int(tail) if tail.isdigit() else None


def saved_model_config(checkpoint: str | Path, fallback: ModelConfig) -> ModelConfig:
    """The model a checkpoint holds: the config it recorded (checkpoints and pretrain exports do), else
    ``fallback``'s (a plain HF directory records none), loading from the checkpoint's directory."""
    ck = resolve_checkpoint(checkpoint)
    saved = _state(ck).get("model_config") or {f.name: getattr(fallback, f.name) for f in dataclasses.fields(fallback)}
    return ModelConfig(**{**saved, "path": str(ck)})
