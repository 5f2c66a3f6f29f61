"""Broker configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


REPLAY_SCOPES = ("off", "task", "family")


@dataclass
class TaskSourceConfig:
    """Which tasks tickets hand out."""

    suite: str = "sim:train"
    """task suite; task ids are '<suite>/<seed>'"""
    seed_start: int = 0
    """first task seed"""
    seed_count: int = 100_000
    """number of task seeds to cycle through"""
    shuffle: bool = True
    """visit seeds in a seeded random order rather than ascending"""
    curation: str = "off"
    """off: walk the suite's seeds | adaptive: draw families weighted by how mixed their recent success is"""
    curation_floor: float = 0.1
    """adaptive: weight of a family solved (or failed) every time, against 1 for one solved half the time"""
    curation_halflife_groups: float = 8.0
    """adaptive: groups of a family after which an old outcome counts half in its success estimate"""

    def validate(self) -> None:
        from broker.task_sampler import CURATION_MODES, suite_families
        if self.curation not in CURATION_MODES:
            raise ValueError(f"broker.tasks.curation must be one of {', '.join(CURATION_MODES)}")
        if not 0.0 < self.curation_floor <= 1.0:
            raise ValueError("broker.tasks.curation_floor must be in (0, 1]")
        if self.curation_halflife_groups <= 0:
            raise ValueError("broker.tasks.curation_halflife_groups must be > 0")
        if self.seed_count < 1:
            raise ValueError("broker.tasks.seed_count must be >= 1")
        if self.curation != "off":
            suite_families(self.suite)  # a suite whose families cannot be known fails here, with how to fix it


@dataclass
class BrokerConfig:
    """Trajectory buffer, staleness-bounded admission, durable spill log, batch and control service."""

    groups_per_batch: int = 8
    """B: task groups per learner step"""
    group_size: int = 8
    """G: rollouts per task group (told to actors in each ticket)"""
    eta: int = 2
    """η: staleness bound, max versions between sampling a token and training on it"""
    persist: bool = True
    """fsync each group to the spill log before acking it, and reload unconsumed groups on restart"""
    memory_bytes: int = 1 << 30
    """queued groups beyond this many bytes wait on disk instead of in memory"""
    segment_bytes: int = 256 << 20
    """spill log segment size; fully consumed segments are deleted"""
    max_drain: int = 64
    """messages taken from a socket per loop turn (also the most groups committed per fsync)"""
    lease_s: float = 3600.0
    """a ticket is reclaimed after this long even if its actor still heartbeats"""
    max_task_crashes: int = 2
    """a task whose actor died (or lease ran out) this many times with no group back is not issued again; 0 = never"""
    dynamic_sampling: bool = False
    """drop a group whose episode rewards are all equal when it arrives, so batches fill with groups that teach"""
    success_per_task: int = 8
    """successful trajectories kept per task for Entropulse SFT (and for replay)"""
    success_max_tasks: int = 10_000
    """tasks kept in the success store (least recently added go first)"""
    replay: str = "off"
    """into a group whose rollouts all fail, a stored success no older than replay_max_age (ARPO): off|task|family"""
    replay_max_age: int = 0
    """versions a replayed success may lag the next train version (0: η, the bound every rollout meets)"""
    cross_policy_share: float = 0.0
    """share of each group's rollouts played by the actors' cross policy (actor.cross_policy); 0 = off"""
    dedupe_window: int = 200_000
    """recent group ids remembered to ignore actor retries"""
    metrics_interval_s: float = 5.0
    """seconds between metrics records"""
    prometheus: str = ""
    """HOST:PORT to serve this role's metrics on for Prometheus (ranked roles add their rank); empty = off"""
    stop_grace_s: float = 3.0
    """after a stop Control, keep publishing it this long before exiting"""
    tasks: TaskSourceConfig = field(default_factory=TaskSourceConfig)
    """task source for tickets"""

    def cross_policy_slots(self) -> int:
        """How many of a group's rollouts a ticket gives to the cross policy."""
        return min(self.group_size - 1, int(self.cross_policy_share * self.group_size + 0.5))  # halves up

    def validate(self) -> None:
        from common.metrics.prometheus import check_address
        check_address(self.prometheus, "broker.prometheus")
        if not 0.0 <= self.cross_policy_share < 1.0:
            raise ValueError("broker.cross_policy_share must be in [0, 1): a group keeps a rollout of the current "
                             "policy")
        if self.cross_policy_share > 0 and self.cross_policy_slots() < 1:
            raise ValueError(f"broker.cross_policy_share={self.cross_policy_share:g} gives no rollout of a group of "
                             f"{self.group_size} to the cross policy (share × group_size rounds to 0, or the group "
                             "has one rollout)")
        if self.groups_per_batch < 1 or self.group_size < 1:
            raise ValueError("groups_per_batch and group_size must be >= 1")
        if self.eta < 0:
            raise ValueError("eta must be >= 0")
        if self.max_drain < 1:
            raise ValueError("max_drain must be >= 1")
        if self.max_task_crashes < 0:
            raise ValueError("broker.max_task_crashes must be >= 0 (0: a reclaimed task is always issued again)")
        if self.replay not in REPLAY_SCOPES:
            raise ValueError(f"broker.replay must be one of {', '.join(REPLAY_SCOPES)}")
        if self.replay == "family" and self.tasks.curation == "off":
            raise ValueError("broker.replay=family needs broker.tasks.curation (curated task ids name their family; "
                             "uncurated ones do not): set broker.tasks.curation=adaptive, or use broker.replay=task")
        if self.replay_max_age < 0:
            raise ValueError("broker.replay_max_age must be >= 0 (0: the staleness bound eta)")
        if self.replay != "off" and self.group_size < 2:
            raise ValueError("broker.replay needs broker.group_size >= 2 "
                             "(a success replaces one of a group's rollouts)")
        if self.replay != "off" and self.success_per_task < 1:
            raise ValueError("broker.replay needs broker.success_per_task >= 1 (replay draws from the success store)")
