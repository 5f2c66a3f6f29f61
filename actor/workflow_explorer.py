"""Workflow-guided exploration's exploration policy: which induced workflows (``actor/workflows.py``) to follow,
learned from the episodes they earn.

Per episode of a family the explorer draws one of the family's demonstrations; then at each turn it draws one step
of that demo's lattice with probability softmax(score) over the turn's steps that allow an action on the live
observation, and takes an action drawn uniformly from those the step allows. (The paper draws the whole workflow
before the episode and ends it at a step that allows nothing; drawing among the steps that apply spends no
episode on a constraint the page already rules out.) Scores are kept per (family, turn,
step key), so demonstrations of a family that share a constraint share what is learned about it (the paper keeps
them per demonstration; a family's instances differ in their strings, which the keys abstract away). After the
episode each drawn step's score moves by REINFORCE on the episode's reward, against a running baseline of the
family's rewards: a workflow that succeeds is drawn more often, one whose constraint is too loose or wrong fades.

The explorer is a ``Policy`` of the one episode loop (``actor/episode.py``): its episodes are played, recorded and
judged exactly as the neural policy's, and its successes are trajectories like any other (token ids of the
actions it wrote, log-probs 0: no model sampled them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from actor.engine import Generation
from actor.workflows import Instruction, Step, Workflow, induce
from common import protocol as P


@dataclass
class ExplorerConfig:
    """Workflow-guided exploration's settings."""

    lr: float = 1.0
    """step size of the REINFORCE update of a drawn step's score"""
    baseline_decay: float = 0.9
    """weight of the past in each family's running reward baseline"""
    seed: int = 0
    """the explorer's draws (demo, steps, actions) are deterministic for it"""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError("workflow explorer lr must be > 0")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError("workflow explorer baseline_decay must be in [0, 1)")


@dataclass
class Plan:
    """One episode's draws: the demonstration whose workflow it follows, and a step for each turn it reached."""

    workflow: Workflow
    drawn: list[tuple[int, tuple[Step, ...], Step]] = field(default_factory=list)
    """per lattice turn reached, in order: (turn, the steps that allowed an action on the live page, the one drawn
    among them). Only these draws are credited with the episode's outcome: it may end before the workflow does,
    and a repeating step passes over the turns it stands for."""
    dead_end: int = -1
    """the turn none of whose steps allowed an action on the live page (-1: none)"""


@dataclass
class WorkflowExplorer:
    workflows: dict[str, list[Workflow]]
    """the induced workflows of each family (one per demonstration)"""
    cfg: ExplorerConfig = field(default_factory=ExplorerConfig)
    registry: Any = None
    """the task registry that names a task id's family (``family``)"""

    def __post_init__(self) -> None:
        self.cfg.validate()
        self.scores: dict[tuple[str, int, str], float] = {}  # (family, turn, step key): absent = 0
        self.baseline: dict[str, float] = {}
        self.rng = random.Random(self.cfg.seed)
        self.outcomes: dict[str, list[bool]] = defaultdict(list)  # each episode's success, in order
        self.dead_ends: dict[str, int] = defaultdict(int)

    def family(self, task_id: str) -> str | None:
        """The family of ``task_id`` when the explorer has workflows for it, else None (a task id this registry
        does not know included: the policy plays it)."""
        try:
            family = self.registry.make_task(task_id).family
        except ValueError:
            return None
        return family if self.workflows.get(family) else None

    def probabilities(self, family: str, turn: int, steps: Sequence[Step]) -> list[float]:
        z = [self.scores.get((family, turn, s.key), 0.0) for s in steps]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        return [v / total for v in e]

    def plan(self, family: str) -> Plan:
        """An episode's plan: one of ``family``'s demonstrations, drawn uniformly; its steps are drawn turn by turn
        on the live page (``draw``)."""
        if not self.workflows.get(family):
            raise KeyError(f"no demonstrations of family {family!r} to explore from")
        return Plan(self.rng.choice(self.workflows[family]))

    def draw(self, family: str, plan: Plan, turn: int, applicable: Sequence[Step]) -> Step:
        """A step for ``turn`` among those that allow an action on the live page, by softmax of their scores."""
        pick = self.rng.choices(applicable, self.probabilities(family, turn, applicable))[0]
        plan.drawn.append((turn, tuple(applicable), pick))
        return pick

    def update(self, family: str, plan: Plan, reward: float) -> None:
        """REINFORCE on the steps drawn: each moves by lr x (reward - baseline) x d log p / d score, p the softmax
        over the steps it was drawn among."""
        self.outcomes[family].append(reward > 0)
        self.dead_ends[family] += int(plan.dead_end >= 0)
        b = self.baseline.get(family, reward)
        advantage = reward - b
        self.baseline[family] = self.cfg.baseline_decay * b + (1 - self.cfg.baseline_decay) * reward
        if advantage == 0:
            return
        for t, steps, pick in plan.drawn:
            probs = self.probabilities(family, t, steps)
            for s, p in zip(steps, probs):
                grad = (1.0 if s.key == pick.key else 0.0) - p
                key = (family, t, s.key)
                self.scores[key] = self.scores.get(key, 0.0) + self.cfg.lr * advantage * grad

    def episodes(self, family: str) -> int:
        return len(self.outcomes[family])

    def successes(self, family: str) -> int:
        return sum(self.outcomes[family])

    def player(self, family: str, tokenizer: Any) -> "WorkflowPlayer":
        return WorkflowPlayer(self, family, self.plan(family), tokenizer)

    def summary(self) -> dict[str, dict]:
        """Per family: episodes, successes, dead ends, the success rate over the first and the last quarter of its
        episodes (a family the explorer learned on rises from one to the other), and the most probable step at each
        turn of its demos."""
        out = {}
        for fam, wfs in self.workflows.items():
            best = []
            for t, steps in enumerate(max(wfs, key=lambda w: len(w.steps)).steps):
                probs = self.probabilities(fam, t, steps)
                i = max(range(len(steps)), key=probs.__getitem__)
                best.append(f"{steps[i].key} ({probs[i]:.2f})")
            seen = self.outcomes[fam]
            quarter = max(1, len(seen) // 4)
            rates = {"first_quarter": round(sum(seen[:quarter]) / quarter, 3),
                     "last_quarter": round(sum(seen[-quarter:]) / quarter, 3)} if seen else {}
            out[fam] = {"episodes": len(seen), "successes": sum(seen),
                        "dead_ends": self.dead_ends[fam], **rates, "best_workflow": best}
        return out


def summary_table(summary: dict[str, dict]) -> str:
    """``WorkflowExplorer.summary()`` as a markdown table, a row per family (what ``computerrl pretrain`` prints)."""
    rows = ["| family | episodes | successes | first quarter | last quarter | dead ends | most probable workflow |",
            "|---|---|---|---|---|---|---|"]
    for fam, s in summary.items():
        rows.append(f"| {fam} | {s['episodes']} | {s['successes']} | {s.get('first_quarter', 0):.0%} "
                    f"| {s.get('last_quarter', 0):.0%} | {s['dead_ends']} | {', '.join(s['best_workflow'])} |")
    return "\n".join(rows)


class WorkflowPlayer:
    """One episode's policy. At each turn of its demonstration's workflow it draws a step among those that allow an
    action on the live observation, and takes one of that step's actions, drawn uniformly. A repeating step is
    taken again, each time with an action not taken yet, until it allows none; the workflow then goes on after
    the demo turns it stands for. None (the episode ends) past the workflow's last turn, or at a turn where no
    step allows anything (a dead end)."""

    def __init__(self, explorer: WorkflowExplorer, family: str, plan: Plan, tokenizer: Any):
        self.explorer, self.family, self.plan, self.tok = explorer, family, plan, tokenizer
        self.turn = 0
        self.step: Step | None = None  # the repeating step being taken, if any
        self.taken: set[str] = set()  # its actions so far
        self.instruction: Instruction | None = None  # the first observation's (later ones need not repeat it)

    async def __call__(self, prompt_ids: list[int], obs: dict, images: list) -> Generation | None:
        if self.instruction is None or obs.get("instruction"):
            self.instruction = Instruction.of(str(obs.get("instruction", "")))
        rows = obs.get("tree") or []
        options: list[str] = []
        if self.step is not None:  # a repeating step: again while it allows something new
            options = [a for a in self.step.actions(rows, self.instruction) if a not in self.taken]
            if not options:
                self.turn, self.step, self.taken = self.step.through + 1, None, set()
        if not options:
            steps = self.plan.workflow.steps
            if self.turn >= len(steps):
                return None
            allowed = {s.key: s.actions(rows, self.instruction) for s in steps[self.turn]}
            applicable = [s for s in steps[self.turn] if allowed[s.key]]
            if not applicable:
                self.plan.dead_end = self.turn
                return None
            step = self.explorer.draw(self.family, self.plan, self.turn, applicable)
            options = allowed[step.key]
            if step.repeats:
                self.step = step
            else:
                self.turn += 1
        action = self.explorer.rng.choice(options)
        if self.step is not None:
            self.taken.add(action)
        ids = [*self.tok.encode(action), self.tok.eos_id]
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop", action)


def workflows_of(demos: Sequence[P.Trajectory], registry: Any) -> dict[str, list[Workflow]]:
    """Each family's workflow lattices, one per successful demonstration that kept its trees (``record_demos``
    names a demo ``demo/<task id>``; ``registry`` says the task id's family)."""
    out: dict[str, list[Workflow]] = defaultdict(list)
    for d in demos:
        if not d.success:
            continue  # a demonstrator's slip teaches no workflow
        if not d.trees:
            raise ValueError(f"demonstration {d.traj_id} kept no trees: record it with actor.demos.record_demos")
        family = registry.make_task(d.traj_id.removeprefix("demo/")).family
        out[family].append(induce(family, d.traj_id, d.instruction, d.trees, d.actions))
    return dict(out)


def workflow_explorer(cfg: Any, demos: list[P.Trajectory] | None, rank: int) -> WorkflowExplorer | None:
    """Actor ``rank``'s explorer (its own draws and scores) from the run's workflow demonstrations
    (``actor.workflows``), or None when they are off. ``cfg`` is the run config."""
    if demos is None:
        return None
    from env_server.backend_registry import task_registry
    from env_server.families import kind_of

    w = cfg.actor.workflows
    registry = task_registry(kind_of(w.suite), cfg.env_server.backend)
    workflows = workflows_of(demos, registry)
    if not workflows:
        raise ValueError(f"actor.workflows: none of the {len(demos)} demonstrations of {w.suite} succeeded; there is "
                         "no workflow to explore with")
    return WorkflowExplorer(workflows, dataclasses.replace(w.explorer, seed=w.explorer.seed + rank), registry)


def explored_trajectory(episode: Any, traj_id: str, version: int) -> P.Trajectory:
    """An episode the explorer played, as a trajectory: marked unsampled (its log-probs are not a model's), its
    tokens labelled with ``version``, the policy version whose group it served."""
    traj = episode.trajectory(traj_id)
    return dataclasses.replace(traj, sampled=False, versions=np.full_like(traj.versions, version))


def explore(explorer: WorkflowExplorer, backend: Any, task_ids: Sequence[str], tokenizer: Any,
            prompt_cfg: Any) -> list[P.Trajectory]:
    """Play ``task_ids`` on ``backend`` (in process), each with a workflow the explorer draws for its family, and
    learn from each verdict; the episodes that succeeded, as trajectories (the replay buffer a neural policy is
    trained from)."""
    from actor.episode import LocalEnv, play_episode

    found = []
    for task_id in task_ids:
        family = explorer.registry.make_task(task_id).family
        player = explorer.player(family, tokenizer)
        episode = asyncio.run(play_episode(LocalEnv(backend), player, task_id, tokenizer, prompt_cfg))
        success = bool(episode.evaluation["success"])
        explorer.update(family, player.plan, float(success))
        if success and episode.turns:
            found.append(explored_trajectory(episode, f"workflow/{task_id}", 0))
    return found
