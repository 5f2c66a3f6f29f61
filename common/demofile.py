"""Recorded demonstrations on disk: one file of trajectories (the wire codec's ``TrajectoryGroup``) with the
settings that produced them, so a reader can tell demos made for another prompt or tokenizer from its own.
``write_group`` and ``read_group`` are that file form for any group (the learner's set-aside groups use it too)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import msgpack

from common import protocol as P


def run_demo_sets(cfg: Any) -> dict[str, dict]:
    """The demonstration sets a run records once into its directory, by name, each with what it depends on (the
    suite, count, route and seed, the prompt layout and the tokenizer): ``anchor`` (``learner.anchor``: the learner
    replays them) and ``workflows`` (``actor.workflows``: the actors induce workflows from them), where enabled.
    ``cfg`` is the run config."""
    m = cfg.model
    common = {"prompt": dataclasses.asdict(cfg.actor.prompt), "tokenizer": [m.tokenizer, m.tokenizer_path or m.path]}
    sets = {}
    a, w = cfg.learner.anchor, cfg.actor.workflows
    if a.enabled:
        sets["anchor"] = {"suite": a.suite, "demos": a.demos, "route": a.route, "seed": a.seed, **common}
    if w.enabled:
        sets["workflows"] = {"suite": w.suite, "demos": w.demos, "route": "gui", "seed": 0, **common}
    return json.loads(json.dumps(sets))  # the types a msgpack round trip gives back


class DemoFileError(RuntimeError):
    """Missing, unreadable, or recorded with other settings than the reader's."""


def write_group(path: Path, group: P.TrajectoryGroup) -> None:
    """``group``'s wire frames packed in one msgpack array, written atomically (temporary file, fsync, rename): a
    reader sees the old file or the whole new one."""
    frames = [bytes(f) for f in P.encode(group)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(frames, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_group(path: Path, what: str = "trajectories") -> P.TrajectoryGroup:
    """The group ``write_group`` wrote to ``path``; ``DemoFileError`` (naming ``what`` was expected) when it is
    missing or holds none."""
    if not path.exists():
        raise DemoFileError(f"no {what} at {path}")
    try:
        group = P.decode(msgpack.unpackb(path.read_bytes(), raw=False), max_bytes=None)
    except (OSError, ValueError, P.ProtocolError, msgpack.UnpackException) as exc:
        raise DemoFileError(f"{path} is not a {what} file: {exc}") from None
    if not isinstance(group, P.TrajectoryGroup):
        raise DemoFileError(f"{path} holds a {type(group).__name__}, not {what}")
    return group


def save(path: Path, trajectories: list[P.Trajectory], settings: dict) -> None:
    """The demonstrations with the settings that produced them (``write_group``)."""
    write_group(path, P.TrajectoryGroup(group_id="demos", ticket_id="demos", task_id=str(settings.get("suite", "")),
                                        actor_id="demos", trajectories=trajectories, behavior_version_min=0,
                                        behavior_version_max=0, created_at=0.0, complete=True,
                                        info={"settings": settings}))


def load(path: Path, settings: dict) -> list[P.Trajectory]:
    """The trajectories of ``path``, which must have been recorded with exactly ``settings``."""
    group = read_group(path, "demonstrations")
    recorded: Any = group.info.get("settings")
    if recorded != settings:
        raise DemoFileError(f"{path} was recorded with other settings ({recorded}) than this run's ({settings})")
    return list(group.trajectories)
