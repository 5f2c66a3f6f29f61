"""A run's recorded episodes, joined with what became of them: the episode log (``common/episode_log.py``) gives
the episodes and the learner's advantages, the audit trail what the learner did with each group. The groups the
learner set aside because their steps killed it (``learner/quarantine.py``) are shown too, recorded or not: they are
the episodes someone will want to read."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from actor.recorder import trajectory_record
from common.audit import group_fates, read_events
from common.demofile import DemoFileError, read_group
from common.episode_log import LEARNER_FILE, read_records
from common.images import ImageStore
from common.rundir import RunDir

SET_ASIDE = "set aside"
"""the source of an episode of a group the learner set aside (``learner/quarantine.py``)"""


class NoEpisodes(Exception):
    """The directory holds no recorded episode: not a run, a run from before episodes were recorded, or a run that
    recorded none. The message says which and what to do."""


@dataclass
class EpisodeSet:
    """Every recorded episode of a run, newest policy last, with what the viewer needs beside it."""

    run: Path
    episodes: list[dict]
    images: ImageStore
    skipped: collections.Counter = field(default_factory=collections.Counter)
    """lines not shown: ``torn`` (not JSON: a crash mid-write), ``other_version`` (another format version)"""

    def by_id(self, episode_id: str) -> dict:
        for ep in self.episodes:
            if ep["id"] == episode_id:
                return ep
        close = [e["id"] for e in self.episodes if e["id"].startswith(episode_id[:4])][:5]
        raise KeyError(f"no episode {episode_id!r} in {self.run}" + (f"; similar: {', '.join(close)}" if close else ""))


def version_of(ep: dict) -> int | None:
    """The policy version an episode was played with: its evaluation's, else the newest its turns sampled from."""
    if ep.get("source") == "eval":
        return ep.get("eval_version")
    v = ep.get("version")
    return v[-1] if isinstance(v, list) and v else None


def load(run_dir: str | Path) -> EpisodeSet:
    root = Path(run_dir)
    if not root.is_dir():
        raise NoEpisodes(f"{root} is not a directory")
    rd = RunDir(root.resolve())
    files = sorted(rd.episodes.glob("*.jsonl")) if rd.episodes.is_dir() else []
    aside = sorted(rd.quarantine.glob("*.msgpack")) if rd.quarantine.is_dir() else []
    if not files and not aside:
        what = "a run directory" if rd.is_run() else RunDir.NOT_A_RUN
        raise NoEpisodes(f"no recorded episodes in {rd.root} ({what}): runs record a sample of their training "
                         "groups (actor.record.every, families, outcome) and every held-out evaluation episode into "
                         "<run>/episodes/; a run from before that has none")
    skipped: collections.Counter = collections.Counter()
    advantages: dict[str, dict] = {}
    episodes: list[dict] = []
    for f in files:
        for rec in read_records(f, skipped):
            if f.name == LEARNER_FILE and isinstance(rec.get("group"), str) and isinstance(rec.get("advantages"), dict):
                advantages[rec["group"]] = rec
            elif f.name != LEARNER_FILE and isinstance(rec.get("id"), str) and isinstance(rec.get("turns"), list):
                episodes.append(rec)
            else:
                skipped["malformed"] += 1
    recorded = {ep["id"] for ep in episodes}
    for path in aside:
        try:
            group = read_group(path)
        except DemoFileError:  # a torn or foreign file: counted like a torn line
            skipped["unreadable_set_aside"] += 1
            continue
        episodes += [rec for i in range(len(group.trajectories))
                     if (rec := trajectory_record(group, i, SET_ASIDE))["id"] not in recorded]
    fates = group_fates(read_events(rd.audit / "broker.jsonl"), read_events(rd.audit / "learner.jsonl"))
    for ep in episodes:
        g = ep.get("group", "")
        if ep.get("source") == "eval":
            ep["fate"] = "evaluation"
        else:
            ep["fate"] = fates.get(g, "not settled yet")
            learned = advantages.get(g, {})
            per_turn = learned.get("advantages", {}).get(ep["id"])
            if per_turn:  # [[turn, advantage], ...] as the learner weighed them
                ep["advantages"] = {int(k): float(a) for k, a in per_turn}
            trained, behaviour = learned.get("trained_version"), ep.get("version")
            if isinstance(trained, int) and isinstance(behaviour, list) and behaviour:
                # as the learner measures it: the policy its step started from, less the oldest sampling version
                ep["lag"] = trained - 1 - int(behaviour[0])
    episodes.sort(key=lambda e: (version_of(e) if version_of(e) is not None else -1, e.get("t", 0.0)))
    return EpisodeSet(rd.root, episodes, ImageStore(rd.images), skipped)
