"""The step of a group the learner set aside (``learner/quarantine.py``), run again in one process.

A group is set aside because steps over it killed the learner: a segfault, an abort, the OOM killer, or a rank's
failure that took the others with it. To find out why, one wants that step alone, in one process, where a debugger,
``faulthandler`` or ``CUDA_LAUNCH_BLOCKING=1`` can see it. ``replay_step`` rebuilds the learner's trainer as the run
had it (its config, the anchor demonstrations recorded in its directory, a checkpoint: the latest by default) on one
rank and trains that group alone, with no staleness bound. Nothing is written: the run directory is read, not changed.

``computerrl replay-step RUN GROUP`` is the command (``launch/cli/tool_commands.py``); ``RUN all`` runs it for every
group set aside there, each in a process of its own, and says which of them kill it: the first crash of a batch
counts against all its groups, and the others of a batch set aside together train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import demofile
from common import protocol as P
from common.images import ImageStore
from common.rundir import RunDir
from learner import checkpoint as ckpt
from learner import quarantine


def find_group(run_dir: RunDir, group: str) -> P.TrajectoryGroup:
    """``group``: a file ``learner/quarantine.py`` wrote, or the id of a group set aside in ``run_dir``."""
    path = Path(group)
    if not path.is_file():
        path = run_dir.quarantine / f"{group}.msgpack"
    if not path.is_file():
        held = sorted(p.stem for p in run_dir.quarantine.glob("*.msgpack")) if run_dir.quarantine.is_dir() else []
        raise FileNotFoundError(f"no group {group!r} set aside in {run_dir.quarantine}: "
                                + (f"those set aside are {', '.join(held)}" if held else "none is set aside there"))
    return demofile.read_group(path)


def replay_step(cfg: Any, run_dir: RunDir, group: P.TrajectoryGroup, anchor_demos: list[P.Trajectory] | None,
                checkpoint: Path | None = None) -> dict:
    """Train ``group`` alone from ``checkpoint`` (the run's latest when None; the initial weights when it has none)
    with the run's learner config ``cfg``; returns what the step reported. A damaged checkpoint raises
    ``CheckpointDamaged`` before any weight is read."""
    from learner.trainer import Trainer

    trainer = Trainer(cfg.learner, cfg.model, cfg.actor.sampling.temperature, cfg.run.seed, None, anchor_demos,
                      ImageStore(run_dir.images))
    if checkpoint is not None:
        ckpt.check_whole(checkpoint, contents=True)  # a truncated one: what to do, not torch's traceback
    path = checkpoint if checkpoint is not None else ckpt.resume_point(run_dir.checkpoints, contents=True)
    if path is not None:
        trainer.load(str(path))
    start = trainer.version
    if group.group_id.startswith(quarantine.SUCCESS_PREFIX):  # a stored success: it was in an SFT step
        m = trainer.sft_step(group.trajectories, cfg.learner.entropulse.sft_lr) or {"empty": "no samples"}
        m["outcomes"] = {group.group_id: "trained" if "empty" not in m else m["empty"]}
    else:
        m = trainer.train_step([group], None)
    m.pop("recorded_advantages", None)
    return {"group": group.group_id, "checkpoint": str(path) if path is not None else None, "from_version": start,
            **{k: v for k, v in m.items() if isinstance(v, (bool, int, float, str, dict))}}

