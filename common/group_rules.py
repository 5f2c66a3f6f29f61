"""The two rules the broker and the learner both apply to a trajectory group, written once: how stale it is
(the staleness bound η, ``docs/architecture.md``) and whether its rewards carry any signal.

The broker applies them when a group arrives and when it forms a batch; the learner applies them again before it
trains (a group may have waited through an SFT phase, and the learner's advantage level decides which rewards
count)."""

from __future__ import annotations

from typing import Iterable

REWARD_SPREAD_EPS = 1e-12
"""rewards closer together than this are equal (float noise in a verifier's score is not a learning signal)"""


def group_lag(train_version: int, behavior_version_min: int) -> int:
    """Versions between the oldest token of a group and the version it would be trained at."""
    return train_version - behavior_version_min


def too_stale(train_version: int, behavior_version_min: int, eta: int | None) -> bool:
    """A group trained at ``train_version`` breaks the bound: its lag exceeds η (``None``: no bound)."""
    return eta is not None and group_lag(train_version, behavior_version_min) > eta


def no_reward_variance(rewards: Iterable[float]) -> bool:
    """Rewards that cannot rank one rollout above another: fewer than two, or all equal. A group-relative
    advantage is zero everywhere for such a group."""
    rs = [float(r) for r in rewards]
    return len(rs) < 2 or max(rs) - min(rs) < REWARD_SPREAD_EPS
