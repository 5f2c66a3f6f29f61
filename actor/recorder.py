"""Which episodes an actor records for people to read (``computerrl episodes``), and what a record of one holds.

One JSON line per episode in ``<run>/episodes/<writer>.jsonl`` (written by ``common.episode_log.EpisodeWriter``):
the task (id, family, split, instruction), per turn the observation text the policy saw and its screenshots by
digest (``<run>/images/``), the sampled text, what the desktop answered, the token count, mean log-prob and policy
version; at the end the reward, success and how it ended, with the rewards of its whole group. What the learner then
did with the group (trained at version k, or dropped and why) is in the audit trail, its advantages in
``episodes/learner.jsonl``: the viewer joins them by group id. Records are built from data the episode already holds
and written by a thread of their own, under a disk budget per writer; what does not fit, or finds the writer's queue
full, is counted, never waited for.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from common.episode_log import RECORD_VERSION

OUTCOMES = ("", "success", "fail")


@dataclass
class RecordConfig:
    """Which played episodes are written to ``<run>/episodes/`` for ``computerrl episodes``."""

    every: int = 20
    """record one training group in this many, all its episodes (chosen by group id; 0 = none by sampling)"""
    families: list[str] = field(default_factory=list)
    """also record every group of these task families"""
    outcome: str = ""
    """also record every group with an episode of this outcome: success | fail ("" = none)"""
    max_mb: float = 200.0
    """disk budget of each writer's file (an actor's, the evaluations'); past it episodes are counted, not written"""

    def validate(self) -> None:
        if self.every < 0 or self.max_mb <= 0:
            raise ValueError("actor.record.every must be >= 0 and actor.record.max_mb > 0")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"actor.record.outcome must be one of {OUTCOMES[1:]} or empty, not {self.outcome!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.every or self.families or self.outcome)

    def wants(self, group_id: str, family: str, successes: Iterable[bool]) -> bool:
        """Whether a training group is recorded: its id's hash in one of ``every`` slots, its family asked for,
        or an episode of the asked outcome in it."""
        if self.every and zlib.crc32(group_id.encode()) % self.every == 0:
            return True
        if family in self.families:
            return True
        s = list(successes)
        return (self.outcome == "success" and any(s)) or (self.outcome == "fail" and not all(s))


def split_of(task_id: str) -> str:
    """The split a task id names (``kind:split[:families]/seed``), or "" for an id of another form."""
    parts = task_id.rpartition("/")[0].split(":")
    return parts[1] if len(parts) > 1 else ""


def _turn_record(t: Any, result: str, seconds: float | None) -> dict:
    """One turn (a ``TurnView``: the policy's side of it) with the desktop's answer and how long the step took."""
    n = len(t.output_ids)
    return {"obs": t.observation, "images": list(t.images), "text": t.action, "result": result,
            "format_error": bool(t.format_error), "tokens": n,
            "logprob": round(float(t.logprobs.mean()), 4) if n else None,
            "version": int(t.versions.max()) if len(t.versions) else None, "seconds": seconds}


def _record(episode_id: str, source: str, task_id: str, turns: list[dict], **fields: Any) -> dict:
    return {"v": RECORD_VERSION, "id": episode_id, "source": source, "task": task_id, "split": split_of(task_id),
            "steps": len(turns), "turns": turns, **fields}


def episode_record(ep: Any, episode_id: str, source: str, **extra: Any) -> dict:
    """A JSON-ready record of one played ``actor.episode.Episode``."""
    turns = [_turn_record(t, ep.results[i] if i < len(ep.results) else "",
                          round(ep.step_seconds[i], 4) if i < len(ep.step_seconds) else None)
             for i, t in enumerate(ep.turns)]
    ev = ep.evaluation
    return _record(episode_id, source, ep.task_id, turns, family=str(ev.get("family", "")),
                   instruction=ep.instruction, reward=float(ev.get("reward", 0.0)),
                   success=bool(ev.get("success", False)), finish=ep.finish_reason, format_errors=ep.format_errors,
                   t=round(time.time(), 3), **extra)


def trajectory_record(group: Any, index: int, source: str, **extra: Any) -> dict:
    """A record of a group's ``index``-th trajectory from what the wire carries (a ``P.TrajectoryGroup``: one the
    learner set aside, ``learner/quarantine.py``). Per turn: the observation, the sampled text, tokens, mean log-prob
    and version; the desktop's answers, the instruction and how the episode ended are not carried, so left empty."""
    tr = group.trajectories[index]
    turns = [_turn_record(tr.turn(i), "", None) for i in range(tr.num_turns)]
    return _record(tr.traj_id, source, group.task_id, turns, family="", instruction="", reward=float(tr.reward),
                   success=bool(tr.success), finish="", format_errors=int(tr.format_errors.sum()), t=0.0,
                   group=group.group_id, index=index, group_rewards=[float(x.reward) for x in group.trajectories],
                   version=[int(group.behavior_version_min), int(group.behavior_version_max)], **extra)
