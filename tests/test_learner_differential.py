"""The learner's step is one function of its batch, however the batch is cut into passes.

Each seed draws an objective (loss, KL term, importance-weight mode and level, temperature, advantage estimator and
weighting, gradient clip) and batches of GRPO groups: multi-turn rollouts of random lengths and loss masks whose
first turns share their group's prompt, and whose later turns share a prompt where rollouts took the same actions;
behaviour log-probs near the policy's, some far off (masked or clamped); now and then a workflow explorer's
episode, trained by its own term. Three trainers with the same weights take
the same two steps: every row in one pass, rows cut into small micro-batches, and small micro-batches with prompts
that several rows begin with run once (``share_prompts``). Their metrics and weights must agree: the token-mean loss
does not see where passes begin, and a shared prompt's states are those of every row's. Every metric but those that
say how the batch was cut (``CUT``) must agree.

``COMPUTERRL_LEARNER_SEEDS=N`` runs N seeds instead of the quick tier's few (a soak)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common import protocol as P  # noqa: E402
from learner.advantages import AdvantageConfig  # noqa: E402
from learner.config import LearnerConfig, LossConfig  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from policy.model import ModelConfig, sequence_logprobs  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
SEEDS = int(os.environ.get("COMPUTERRL_LEARNER_SEEDS", "0")) or 6
CUT = ("micro_batches", "prompt_tokens_shared", "tokens_per_s")
"""the metrics that say how a batch was cut into passes (and how fast they ran): every other one must agree"""


def draw_config(rng: random.Random) -> tuple[LearnerConfig, float]:
    loss = LossConfig(name=rng.choice(["grpo", "ppo", "reinforce"]), kl_beta=rng.choice([0.0, 0.1]),
                      w_mode=rng.choice(["mask", "clamp", "off"]), w_level=rng.choice(["token", "sequence"]),
                      w_max=rng.choice([2.0, 5.0]))
    name = rng.choice(["group", "rloo"])
    level = rng.choice(["trajectory", "step"]) if name == "group" else "trajectory"  # (step: group's alone)
    advantage = AdvantageConfig(name=name, level=level, std=rng.random() < 0.5,
                                weighting=rng.choice(["token", "trajectory"]))
    cfg = LearnerConfig(lr=1e-3, grad_clip=rng.choice([0.0, 1.0, 0.05]), loss=loss, advantage=advantage,
                        broadcast_weights=False)
    return cfg, rng.choice([1.0, 0.7])


def draw_groups(rng: random.Random, policy, version: int) -> list[P.TrajectoryGroup]:
    """Groups as actors send them; behaviour log-probs from ``policy`` (the weights all trainers start from) with
    noise, some tokens far off."""
    groups = []
    for k in range(rng.randint(1, 4)):
        prompt = [rng.randrange(1, 256) for _ in range(rng.randint(4, 40))]
        first_actions: list[list[int]] = []
        trajs = []
        for i in range(rng.choice([2, 3, 4])):
            turns, history = [], list(prompt)
            for turn in range(rng.randint(1, 3)):
                if turn == 0 and first_actions and rng.random() < 0.5:
                    action = list(rng.choice(first_actions))  # the same first action: the next prompt is shared too
                else:
                    action = [rng.randrange(1, 256) for _ in range(rng.randint(1, 12))]
                if turn == 0:
                    first_actions.append(action)
                with torch.no_grad():
                    lp = sequence_logprobs(policy, torch.tensor([history + action]))[0, len(history) - 1:].numpy()
                lp = np.minimum(lp + np.array([rng.gauss(0, 0.1) for _ in action]), -1e-3)
                lp[[j for j in range(len(action)) if rng.random() < 0.1]] = -12.0  # (far off: masked or clamped)
                mask = np.array([rng.random() > 0.15 for _ in action], np.uint8)
                reward = float(rng.choice([0, 1, 1, 0.5]))
                turns.append(P.TurnView(np.array(history, np.int32), np.array(action, np.int32),
                                        lp.astype(np.float32), np.full(len(action), version, np.int32), mask,
                                        reward, False, "", ""))
                history = history + action + [rng.randrange(1, 256) for _ in range(rng.randint(1, 8))]
            trajs.append(P.Trajectory.from_turns(uuid.uuid4().hex[:8], turns[-1].reward, turns[-1].reward == 1.0,
                                                 turns))
        if rng.random() < 0.35:  # the workflow explorer's episode (no model sampled it), trained by its own term
            i, success = rng.randrange(len(trajs)), rng.random() < 0.7
            t = trajs[i]
            trajs[i] = dataclasses.replace(t, sampled=False, success=success, reward=float(success),
                                           turn_rewards=np.full_like(t.turn_rewards, float(success)),
                                           logprobs=np.zeros_like(t.logprobs))
        groups.append(P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id=f"sim:train/{k}",
                                        actor_id="a", trajectories=trajs, behavior_version_min=version,
                                        behavior_version_max=version))
    return groups


def run_seed(seed: int) -> dict:
    rng = random.Random(seed)
    cfg, temperature = draw_config(rng)
    small = rng.choice([48, 96, 160])
    arms = {"one pass": dataclasses.replace(cfg, micro_batch_tokens=1 << 20, share_prompts=False),
            "micro-batches": dataclasses.replace(cfg, micro_batch_tokens=small, share_prompts=False),
            "shared prompts": dataclasses.replace(cfg, micro_batch_tokens=small, share_prompts=True)}
    trainers = {name: Trainer(c, TINY, temperature=temperature, seed=0) for name, c in arms.items()}
    start = trainers["one pass"].model
    batches = [draw_groups(rng, start, 0) for _ in range(2)]
    where = f"seed {seed}, micro_batch_tokens {small}, temperature {temperature}, {cfg.loss}, {cfg.advantage}, " \
            f"grad_clip {cfg.grad_clip}"
    shared = passes = explored = 0
    for step, groups in enumerate(batches):
        results = {name: t.train_step(groups) for name, t in trainers.items()}
        base = results["one pass"]
        if "empty" in base:
            assert all("empty" in r for r in results.values()), where
            continue
        for name, r in results.items():
            assert r["outcomes"] == base["outcomes"] and set(r) == set(base), f"{where}, step {step}, {name}"
            for key in sorted(set(base) - {"outcomes", *CUT}):
                a, b = float(base[key]), float(r[key])
                assert math.isclose(a, b, rel_tol=2e-4, abs_tol=2e-5), \
                    f"{where}, step {step}, {name}: {key} {b} against one pass's {a}"
        # The step's gradient (clipped), as one vector: Adam divides each weight's step by its gradient's running
        # size, so a weight whose gradient is near 0 moves by up to lr on float noise alone; the gradient does not.
        grads = {name: torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])
                 for name, t in trainers.items()}
        for name, g in grads.items():
            off = float((g - grads["one pass"]).norm() / grads["one pass"].norm())
            assert off < 1e-4, f"{where}, step {step}, {name}: the gradient differs by {off:.2e} of its norm"
        explored += int(base.get("explored_tokens", 0))
        shared += results["shared prompts"]["prompt_tokens_shared"]
        passes += results["micro-batches"]["micro_batches"]
    params = {name: [p.detach() for p in t.model.parameters()] for name, t in trainers.items()}
    for name, ps in params.items():
        for a, b in zip(params["one pass"], ps):
            assert torch.allclose(a, b, atol=0.1 * cfg.lr), \
                f"{where}: {name}'s weights differ by {(a - b).abs().max():.2e}"
    return {"prompt_tokens_shared": shared, "micro_batches": passes, "explored_tokens": explored}


@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_step_is_the_same_whatever_passes_its_batch_is_cut_into(seed):
    run_seed(seed)


def test_the_random_batches_share_prompts_and_take_several_passes():
    """The batches drawn share prompts, take several micro-batches and train explored episodes (the test above would
    pass without them)."""
    totals = [run_seed(seed) for seed in range(3)]
    assert sum(t["prompt_tokens_shared"] for t in totals) > 0 and sum(t["explored_tokens"] for t in totals) > 0
    assert sum(t["micro_batches"] for t in totals) > 4
