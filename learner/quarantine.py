"""Groups whose training steps killed the learner process, remembered across its restarts and set aside.

A step that raises is caught where it raises (``Learner._step``: its batch is dropped as ``step_failed``). Some
failures cannot be caught there: a segfault or an abort in a kernel, the kernel's OOM killer, and with several
learner ranks any failure at all (one rank's error leaves the others inside the step's collectives, and the whole
group dies). The groups of such a step were never committed, so the restarted learner gets them again from the
broker, and dies again: a crash loop until the supervisor gives the run up. (An SFT step's stored successes come back
too: the restarted learner asks the store with the same seed, its version.)

So rank 0 writes the ids of what a step trains to ``step-in-flight.json`` before the step, and removes the file once
the step has ended in this process. A learner that finds the file at its start knows its predecessor died inside that
step, and counts one crash against each of the step's groups (``crashes.json``; an SFT step's stored successes by
``success_key``). A group counted ``max_crashes`` times is not trained again: at its next delivery it is settled as
dropped (``step_crashed``) and its data written beside, as ``<group_id>.msgpack`` (``demofile.write_group``), for
whoever looks into the crash; a stored success is left out of its SFT step and written the same way.

Which of a batch's groups broke its step cannot be told from the crash, so every group of that step is counted. To
tell them apart, a batch that holds groups counted before is preceded by a probe of each of them alone: the step's
passes over that group without its update (``Trainer.probe_step``), under a record of its own. A group that kills
the learner again in its probe is counted alone, and set aside alone; its batch partners pass their probes and are
trained. A crash that only a whole batch causes (its size, say) kills the batch's step again, and all its groups are
counted, and then set aside, together.

The files are written without fsync: what they guard against is the learner process dying, not the machine (a node
that loses its page cache loses at most one crash's count). A file system that refuses them costs the count, not the
run: the failure is logged and training goes on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from common import demofile
from common import protocol as P
from common.net.security import RateLimitedLog

IN_FLIGHT = "step-in-flight.json"
CRASHES = "crashes.json"
SUCCESS_PREFIX = "success-"
"""what a stored success's key begins with (``success_key``), apart from group ids"""


class CrashedSteps:
    """The crash counts of groups, the step in flight, and the groups set aside, in one directory (see the module)."""

    def __init__(self, root: Path, max_crashes: int, log: Any):
        self.root, self.max_crashes, self.log = Path(root), max_crashes, log
        self._rate_limited = RateLimitedLog(log, 60.0)
        counts = self._read(self.root / CRASHES, {})
        self.crashes: dict[str, int] = {str(k): v for k, v in counts.items() if isinstance(v, int) and v > 0}
        self._in_flight = False
        self._settled: list[str] = []  # keys settled since the last checkpoint (``settled``)
        self.found: list[str] = []
        """the groups of the step a predecessor died in (found at this start), each counted once more"""
        previous = self._read(self.root / IN_FLIGHT, None)
        if previous is not None:
            groups = previous.get("groups")
            self.found = [str(g) for g in groups] if isinstance(groups, list) else []
            for g in self.found:
                self.crashes[g] = self.crashes.get(g, 0) + 1
            if self._write(CRASHES, self.crashes):
                self._remove(IN_FLIGHT)
            log.error("step_crashed", batch=previous.get("batch", ""), version=previous.get("version"),
                      groups=len(self.found), crashes={g: self.crashes[g] for g in self.found},
                      max_crashes=self.max_crashes,
                      hint="the learner died inside this step (a crash no step can catch, or a rank's failure); "
                           f"its groups are set aside once counted {self.max_crashes} times")

    def counted_out(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys`` (group ids, or ``success_key``s), those counted ``max_crashes`` times: not to be trained. None
        with ``max_crashes`` 0 (off)."""
        if self.max_crashes <= 0:
            return []
        return [k for k in keys if self.crashes.get(k, 0) >= self.max_crashes]

    def suspects(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys``, those counted in a step that killed the learner but not yet set aside: tried alone before
        their batch's step (``Learner._probe``), so that a crash they cause again is counted against them alone."""
        if self.max_crashes <= 0:
            return []
        return [k for k in keys if 0 < self.crashes.get(k, 0) < self.max_crashes]

    def set_aside(self, items: dict[str, Any], as_group: Callable[[Any], P.TrajectoryGroup] = lambda g: g) -> set[str]:
        """Of ``items`` (groups, or stored successes, by key), the keys of those ``counted_out``, each kept on disk
        (``as_group`` makes what is written of an item)."""
        out = set(self.counted_out(items))
        for k in out:
            self.keep(k, as_group(items[k]))
        return out

    def keep(self, key: str, group: P.TrajectoryGroup) -> None:
        """Write what was set aside under ``key`` to ``<key>.msgpack`` (``demofile.read_group`` reads it), for whoever
        looks into the crash."""
        try:
            demofile.write_group(self.root / f"{key}.msgpack", group)
        except OSError as exc:
            self._rate_limited.error("quarantine_write_failed", ("group",), name=key, error=repr(exc))

    def begin(self, batch_id: str, version: int, group_ids: Sequence[str]) -> None:
        """A step over these groups starts."""
        if self.max_crashes > 0 and group_ids:
            self._in_flight = self._write(IN_FLIGHT, {"batch": batch_id, "version": version, "groups": list(group_ids)})

    def end(self) -> None:
        """The step in flight ended in this process (its groups trained, or dropped where it raised)."""
        if self._in_flight:
            self._in_flight = not self._remove(IN_FLIGHT)

    def settled(self, keys: Iterable[str]) -> None:
        """These groups (or stored successes) are settled, trained or dropped: their counts go at the next
        ``committed``. Not before: a learner that dies before its checkpoint gets them delivered again, and one set
        aside must then be set aside again rather than crash the learner twice more."""
        self._settled += [k for k in keys if k in self.crashes]

    def committed(self) -> None:
        """A checkpoint made the settlements so far durable: forget the counts of what they settled."""
        gone = [k for k in self._settled if self.crashes.pop(k, None) is not None]
        self._settled = []
        if gone:
            self._write(CRASHES, self.crashes)

    def _write(self, name: str, value: Any) -> bool:
        path = self.root / name
        tmp = path.with_name(name + ".tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(value))
            os.replace(tmp, path)  # a reader sees the old file or the whole new one
            return True
        except OSError as exc:
            self._rate_limited.error("crash_record_failed", (name,), file=str(path), error=repr(exc),
                                     hint="a crash in this step may go uncounted")
            return False

    def _remove(self, name: str) -> bool:
        try:
            (self.root / name).unlink(missing_ok=True)
            return True
        except OSError as exc:
            self._rate_limited.error("crash_record_failed", (name,), file=str(self.root / name), error=repr(exc))
            return False

    def _read(self, path: Path, default: Any) -> Any:
        try:
            value = json.loads(path.read_text())
        except FileNotFoundError:
            return default
        except (OSError, ValueError) as exc:
            self.log.error("crash_record_unreadable", file=str(path), error=repr(exc),
                           hint="counts start afresh: a group that crashed the learner is counted from now")
            return default
        return value if isinstance(value, dict) else default


def success_key(sample: P.SuccessSample) -> str:
    """What a stored success (an SFT step's sample) is counted under: its trajectory's id, apart from group ids."""
    return SUCCESS_PREFIX + sample.trajectory.traj_id


def success_group(sample: P.SuccessSample) -> P.TrajectoryGroup:
    """A stored success as a group of one, the form ``keep`` writes."""
    return P.TrajectoryGroup(group_id=success_key(sample), ticket_id="", task_id=sample.task_id, actor_id="",
                             trajectories=[sample.trajectory], behavior_version_min=0, behavior_version_max=0)

