"""Advantage estimators: rewards of a batch's groups -> one advantage per sample (model turn).

An estimator is a function ``(groups: list[GroupRewards], cfg: AdvantageConfig) -> list[list[list[float]]]``
giving ``adv[g][i][t]`` for turn t of trajectory i of group g, selected by name or import path.

- ``group`` (GRPO): ``A = (r - mean_g r) / (std_g r + 1e-6)``, or ``r - mean_g r`` with ``std: false``
  (Dr.GRPO). ``level: trajectory`` uses episode rewards, every turn of a trajectory sharing its advantage;
  ``level: step`` makes every turn of every trajectory in the group a sample with its own turn reward,
  normalised over all the group's turns (ComputerRL's step-level GRPO).
- ``rloo``: ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out baseline), per trajectory.
- ``batch``: ``(r - mean) / (std + 1e-6)`` over the whole batch (PPO-style, no groups).
Then optionally ``per_task`` z-scores advantages among samples of the same task (AgentRL), and
``negative_weight`` scales every negative advantage: 1 is the estimator as written, 0 reinforces successes
only (positive-sample reinforcement, which sharpens the policy: the setting where entropy collapses). With
``weighting: trajectory`` the batch builder rescales each trajectory's advantages by mean length / its length
in loss tokens, so a long failure weighs no more than a short success in the token-mean loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from common.group_rules import no_reward_variance
from common.imports import check_name, load_by_path

EPS = 1e-6


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    name: str = "group"
    """group | rloo | batch | an import path pkg.module:function"""
    level: str = "trajectory"
    """trajectory (episode reward on every turn) | step (each turn its own sample, normalised per group)"""
    std: bool = True
    """divide by the group's reward std (false = Dr.GRPO, mean-centred only)"""
    per_task: bool = False
    """z-score advantages among the samples of each task in the batch"""
    drop_zero_variance: bool = True
    """leave groups with no reward variance at this level out of the loss (broker.dynamic_sampling refills them)"""
    weighting: str = "token"
    """token (every loss token counts alike: long trajectories weigh more) | trajectory (each weighs the same)"""
    negative_weight: float = 1.0
    """scale on negative advantages, after any per-task z-score (0 = reinforce successes only)"""

    def validate(self) -> None:
        if self.level not in ("trajectory", "step"):
            raise ValueError("advantage level must be trajectory or step")
        if self.weighting not in ("token", "trajectory"):
            raise ValueError("advantage weighting must be token or trajectory")
        if not 0.0 <= self.negative_weight <= 1.0:
            raise ValueError("advantage negative_weight must be within [0, 1]")
        if self.level == "step" and self.name in ("rloo", "batch"):
            raise ValueError(f"advantage level 'step' is implemented by the 'group' estimator only, not {self.name!r}")
        check_name(self.name, tuple(ESTIMATORS), "advantage estimator")  # imported by the learner when it starts


@dataclass
class GroupRewards:
    task_id: str
    rewards: list[float]  # per trajectory
    turn_rewards: list[list[float]]  # per trajectory, per turn


Estimator = Callable[[list[GroupRewards], AdvantageConfig], list[list[list[float]]]]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def zero_variance(g: GroupRewards, cfg: AdvantageConfig) -> bool:
    """No advantage anywhere in the group at the configured level: its turn rewards (step) or its episode rewards
    cannot rank one sample above another (``common/group_rules.py``, the rule the broker applies too)."""
    return no_reward_variance([r for t in g.turn_rewards for r in t] if cfg.level == "step" else g.rewards)


def group_relative(groups: list[GroupRewards], cfg: AdvantageConfig) -> list[list[list[float]]]:
    out = []
    for g in groups:
        if cfg.level == "step":
            flat = [r for turns in g.turn_rewards for r in turns]
            m, s = _mean_std(flat) if flat else (0.0, 0.0)
            out.append([[(r - m) / (s + EPS) if cfg.std else r - m for r in turns] for turns in g.turn_rewards])
        else:
            m, s = _mean_std(g.rewards)
            out.append([[(r - m) / (s + EPS) if cfg.std else r - m] * len(turns)
                        for r, turns in zip(g.rewards, g.turn_rewards)])
    return out


def rloo(groups: list[GroupRewards], cfg: AdvantageConfig) -> list[list[list[float]]]:
    out = []
    for g in groups:
        n, total = len(g.rewards), sum(g.rewards)
        adv = [r - (total - r) / (n - 1) if n > 1 else 0.0 for r in g.rewards]
        out.append([[a] * len(turns) for a, turns in zip(adv, g.turn_rewards)])
    return out


def batch_normalised(groups: list[GroupRewards], cfg: AdvantageConfig) -> list[list[list[float]]]:
    rewards = [r for g in groups for r in g.rewards]
    m, s = _mean_std(rewards) if rewards else (0.0, 0.0)
    return [[[(r - m) / (s + EPS)] * len(turns) for r, turns in zip(g.rewards, g.turn_rewards)] for g in groups]


ESTIMATORS: dict[str, Estimator] = {"group": group_relative, "rloo": rloo, "batch": batch_normalised}


def get_estimator(name: str) -> Estimator:
    return ESTIMATORS[name] if name in ESTIMATORS else load_by_path(name)


def compute(groups: list[GroupRewards], cfg: AdvantageConfig) -> list[list[list[float]]]:
    """Advantages per group/trajectory/turn, with per-task normalisation applied if configured."""
    adv = get_estimator(cfg.name)(groups, cfg)
    if cfg.per_task:
        by_task: dict[str, list[float]] = {}
        for g, a in zip(groups, adv):
            by_task.setdefault(g.task_id, []).extend(x for traj in a for x in traj)
        stats = {k: _mean_std(v) for k, v in by_task.items()}
        adv = [[[(x - stats[g.task_id][0]) / (stats[g.task_id][1] + EPS) for x in traj] for traj in a]
               for g, a in zip(groups, adv)]
    if cfg.negative_weight != 1.0:
        adv = [[[x * cfg.negative_weight if x < 0 else x for x in traj] for traj in a] for a in adv]
    return adv
