"""The learner: training steps on token-in/token-out groups, rejection of bad batches, custom losses by
import path, pi_prox modes, Entropulse transitions, checkpoint/resume, and the process loop with a broker."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from broker.client import ActorBrokerClient  # noqa: E402
from broker.config import BrokerConfig  # noqa: E402
from common import protocol as P  # noqa: E402
from policy.model import ModelConfig, build_model, sequence_logprobs  # noqa: E402
from common.net import free_port  # noqa: E402
from policy.weightsync import WeightSyncConfig  # noqa: E402
from learner.advantages import AdvantageConfig  # noqa: E402
from learner.batch import build_samples  # noqa: E402
from learner.config import AnchorConfig, LearnerConfig  # noqa: E402
from learner.entropulse import Entropulse, EntropulseConfig  # noqa: E402
from learner.losses import LossConfig  # noqa: E402
from learner.process import Learner  # noqa: E402
from learner.trainer import Trainer  # noqa: E402
from tests.conftest import pump  # noqa: E402

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def groups_from(trainer: Trainer, n_groups=2, g=4, seed=0, version=0, good=b"done()", bad=b"fail()",
                same_prompt=False) -> list:
    """Groups whose 'good' trajectories (reward 1) answer with ``good`` and the others with ``bad``;
    behaviour log-probs come from the trainer's own model (as an actor with the same weights records).
    ``same_prompt``: a group's rollouts all begin with one prompt, as a GRPO group's first turns do."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n_groups):
        trajs = []
        group_prompt = rng.integers(0, 256, 20).astype(np.int32) if same_prompt else None
        for i in range(g):
            success = i % 2 == 0
            prompt = group_prompt if same_prompt else rng.integers(0, 256, 20).astype(np.int32)
            answer = np.frombuffer(good if success else bad, np.uint8).astype(np.int32)
            with torch.no_grad():
                ids = torch.tensor([np.concatenate([prompt, answer]).tolist()], device=trainer.device)
                lp = sequence_logprobs(trainer.model, ids)
            lp = lp[0, len(prompt) - 1:].float().cpu().numpy()
            turn = P.TurnView(prompt, answer, lp, np.full(len(answer), version, np.int32),
                              np.ones(len(answer), np.uint8), float(success), False, "obs", "act")
            trajs.append(P.Trajectory.from_turns(uuid.uuid4().hex[:8], float(success), success, [turn]))
        out.append(P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id=f"sim:train/{k}",
                                     actor_id="a", trajectories=trajs, behavior_version_min=version,
                                     behavior_version_max=version))
    return out


def answer_logprob(trainer: Trainer, text: bytes) -> float:
    prompt = list(range(40, 60))
    ids = prompt + list(text)
    with torch.no_grad():
        return float(sequence_logprobs(trainer.model, torch.tensor([ids]))[0, len(prompt) - 1:].sum())


def test_rl_steps_move_probability_towards_rewarded_answers():
    t = Trainer(LearnerConfig(lr=3e-3), TINY)
    before = answer_logprob(t, b"done()") - answer_logprob(t, b"fail()")
    for step in range(15):
        m = t.train_step(groups_from(t, seed=step, version=t.version))
        assert m is not None and m["version"] == step + 1
    after = answer_logprob(t, b"done()") - answer_logprob(t, b"fail()")
    assert after > before + 1.0, (before, after)
    assert {"loss", "entropy", "clip_frac", "is_weight_mean", "grad_norm", "max_lag", "tokens_per_s"} <= set(m)
    assert m["max_lag"] == 0 and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_a_replayed_success_is_trained_but_not_counted_in_the_policys_success_rate():
    t = Trainer(LearnerConfig(), TINY)
    groups = groups_from(t)  # two groups of four, successes at 0 and 2
    groups[0].info["replayed"] = [0]  # the broker's replay put slot 0 there
    groups[1].info["replayed"] = "0"  # not the broker's list: names nothing
    m = t.train_step(groups)
    assert m["groups"] == 2 and m["replayed"] == 1
    assert m["success_rate"] == pytest.approx(3 / 7), "the rollouts played: 1 of 3, and 2 of 4"


def test_a_cross_policy_rollout_is_trained_but_kept_out_of_the_policys_rates_and_lags():
    t = Trainer(LearnerConfig(), TINY)
    groups = groups_from(t)  # two groups of four, successes at 0 and 2, sampled at version 0
    t.version = 3  # three versions on: the current policy's rollouts are 3 behind, as η may allow
    groups[0].trajectories[2].versions[:] = -5  # another policy's tokens, of another lineage
    groups[0].info["cross_policy"] = [2]
    m = t.train_step(groups)
    assert m["groups"] == 2 and m["cross_policy"] == 1 and m["replayed"] == 0
    assert m["success_rate"] == pytest.approx(3 / 7), "the current policy's rollouts: 1 of 3, and 2 of 4"
    assert m["max_lag"] == 3, "the cross-policy rollout's age is not the policy's lag"


def test_a_turn_whose_weights_were_swapped_midway_is_left_out_of_the_numerics_mismatch():
    """Tokens sampled at the learner's version after a swap mid-turn attended over a cache older weights wrote:
    their log-probs differ by what a step changed, not by numerics. The mismatch metric leaves them out (it once
    read 1.42e-4 in a whole run for this reason) and counts them; a turn the current weights sampled whole stays in."""
    t = Trainer(LearnerConfig(), TINY)
    t.train_step(groups_from(t, seed=0))  # version 1
    groups = groups_from(t, seed=1, version=1)
    swapped = groups[0].trajectories[1]
    swapped.versions[:2] = 0  # its first two tokens came from version 0's weights; the swap came after them
    swapped.logprobs[2:] -= 0.01  # what the stale cache did to the rest (exaggerated)
    stale_tokens = len(swapped.versions) - 2
    m = t.train_step(groups)
    assert m["mismatch_tokens_swapped_midturn"] == stale_tokens
    assert m["mismatch_tokens"] == sum(len(tr.versions) for g in groups for tr in g.trajectories) - len(
        swapped.versions)
    assert m["mismatch_abs_max"] < 1e-5, "every turn sampled whole by the current weights scores as the engine did"
    t2 = Trainer(LearnerConfig(), TINY)
    t2.train_step(groups_from(t2, seed=0))
    whole = groups_from(t2, seed=1, version=1)
    whole[0].trajectories[1].logprobs[2:] -= 0.01  # the same error on a turn sampled whole at version 1
    m2 = t2.train_step(whole)
    assert "mismatch_tokens_swapped_midturn" not in m2 and m2["mismatch_abs_max"] == pytest.approx(0.01, rel=1e-3)


def _explored(traj: P.Trajectory, success: bool) -> P.Trajectory:
    """``traj`` as the workflow explorer's: no model sampled it (behaviour log-probs 0)."""
    return dataclasses.replace(traj, sampled=False, success=success, reward=float(success),
                               turn_rewards=np.full_like(traj.turn_rewards, float(success)),
                               logprobs=np.zeros_like(traj.logprobs))


def test_explored_successes_train_the_nll_term_apart_from_the_grpo_comparison():
    t = Trainer(LearnerConfig(lr=3e-3), TINY)
    groups = groups_from(t, g=4)
    # group 0: slot 3 explored and succeeded (it answers "fail()", which the GRPO term pushes down elsewhere)
    groups[0].trajectories[3] = _explored(groups[0].trajectories[3], True)
    # group 1: every sampled rollout failed (no GRPO signal), an explored success: trained for that alone
    g1 = groups[1]
    g1.trajectories[:3] = [dataclasses.replace(tr, success=False, reward=0.0,
                                               turn_rewards=np.zeros_like(tr.turn_rewards)) for tr in g1.trajectories[:3]]
    g1.trajectories[3] = _explored(g1.trajectories[3], True)
    # group 2: only an explored failure beside a tie: nothing to learn
    g2 = groups_from(t, n_groups=1, seed=9)[0]
    g2.trajectories[:] = [dataclasses.replace(tr, success=False, reward=0.0, turn_rewards=np.zeros_like(tr.turn_rewards))
                          for tr in g2.trajectories]
    g2.trajectories[3] = _explored(g2.trajectories[3], False)
    before = answer_logprob(t, b"fail()")
    m = t.train_step(groups + [g2])
    assert m["outcomes"][groups[0].group_id] == m["outcomes"][g1.group_id] == "trained"
    assert m["outcomes"][g2.group_id] == "zero_variance"
    assert m["explored"] == 3 and m["explored_successes"] == 2 and m["explored_tokens"] == 2 * len(b"fail()")
    assert m["explored_nll"] > 0
    assert m["success_rate"] == pytest.approx(2 / 6), "the policy's own rollouts: 2 of 3, and 0 of 3"
    assert answer_logprob(t, b"fail()") > before, "the explored answer's likelihood rose"
    # the GRPO group of group 0 is its three sampled rollouts: the explored one has no advantage to take
    samples, stats = build_samples(groups[:1], AdvantageConfig(), 256, t.version)
    assert len(samples) == 3 and {s.traj_id for s in stats["explored"]} == {groups[0].trajectories[3].traj_id}
    # without the term, a group kept for its explored success alone teaches nothing
    off = Trainer(LearnerConfig(explored_coef=0), TINY)
    m = off.train_step([g1])
    assert m.get("empty") and m["outcomes"][g1.group_id] == "zero_variance"
    # with it, a batch whose only trainable turns are an explored success is a step of that term alone
    alone = Trainer(LearnerConfig(), TINY)
    m = alone.train_step([g1])
    assert m["outcomes"][g1.group_id] == "trained" and m["version"] == 1
    assert m["tokens"] == 0 and m["explored_tokens"] == len(b"fail()")


def test_bad_groups_dropped_one_by_one_and_nonfinite_steps_skipped():
    t = Trainer(LearnerConfig(), TINY)
    groups = groups_from(t)
    groups[0].trajectories[0].logprobs[0] = np.nan
    m = t.train_step(groups)
    assert m["outcomes"] == {groups[0].group_id: "nonfinite_logprobs", groups[1].group_id: "trained"}
    assert m["groups"] == 1 and t.version == 1 and t.counters["groups_dropped_nonfinite_logprobs"] == 1
    # Sampled by a policy newer than the learner's (it rolled back): trained on its recorded log-probs.
    newer = groups_from(t, version=3)
    m = t.train_step(newer)
    assert set(m["outcomes"].values()) == {"trained"} and t.version == 2
    assert t.counters["groups_from_newer_policy"] == 2 and m["max_lag"] == 0
    t2 = Trainer(dataclasses.replace(LearnerConfig(), loss=LossConfig(name="tests.test_learner:nan_loss")), TINY)
    before = [p.clone() for p in t2.model.parameters()]
    m = t2.train_step(groups_from(t2))
    assert m["empty"] and set(m["outcomes"].values()) == {"nonfinite_step"}
    assert t2.counters["steps_skipped_nonfinite"] == 1 and t2.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, t2.model.parameters()))
    same = groups_from(t)
    for tr in same[0].trajectories + same[1].trajectories:
        tr.reward = 1.0
        tr.turn_rewards[:] = 1.0
    m = t.train_step(same)
    assert m["empty"] and set(m["outcomes"].values()) == {"zero_variance"}
    assert t.counters["groups_dropped_zero_variance"] == 2


def test_incomplete_groups_are_never_trained_on():
    t = Trainer(LearnerConfig(), TINY)
    complete, broken = groups_from(t, n_groups=2)
    broken = dataclasses.replace(broken, complete=False)
    m = t.train_step([complete, broken])
    assert m["groups"] == 1 and m["samples"] == len(complete.trajectories)
    assert m["outcomes"][broken.group_id] == "incomplete"
    m = t.train_step([dataclasses.replace(complete, complete=False)])
    assert m["empty"] and t.version == 1


def nan_loss(inp, cfg):
    from learner.losses import LossOutputs

    return LossOutputs(inp.logprobs.sum() * float("nan"))


def test_custom_loss_by_import_path_trains():
    cfg = dataclasses.replace(LearnerConfig(lr=3e-3), loss=LossConfig(name="learner.example_loss:gspo_loss",
                                                                        eps_low=0.2, eps_high=0.2))
    t = Trainer(cfg, TINY)
    before = answer_logprob(t, b"done()") - answer_logprob(t, b"fail()")
    for step in range(15):
        m = t.train_step(groups_from(t, seed=step, version=t.version))
    assert "seq_ratio_mean" in m
    assert answer_logprob(t, b"done()") - answer_logprob(t, b"fail()") > before + 1.0


def counting_loss(inp, cfg):
    """GRPO, reporting each micro-batch's loss tokens three ways: as a mean, a max and a sum."""
    from learner.losses import grpo_loss

    out = grpo_loss(inp, cfg)
    n = float(inp.mask.sum())
    out.metrics.update(mb_tokens_mean=n, mb_tokens_max=n, mb_tokens_sum=n)
    out.reduce.update(mb_tokens_max="max", mb_tokens_sum="sum")
    return out


def test_one_lr_schedule_warm_up_then_cosine_to_its_floor():
    import math

    cfg = LearnerConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.0)
    t = Trainer(cfg, TINY)
    factors = [t._lr_factor(s) for s in range(7)]
    assert factors[:2] == [0.5, 1.0] and factors[2] == 1.0 and factors[6] == 0.0
    assert factors[4] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    floor = Trainer(dataclasses.replace(cfg, min_lr_ratio=0.1), TINY)
    assert floor._lr_factor(6) == pytest.approx(0.1)


def test_a_loss_says_how_each_metric_combines_over_micro_batches():
    cfg = dataclasses.replace(LearnerConfig(micro_batch_tokens=64),
                              loss=LossConfig(name="tests.test_learner:counting_loss"))
    t = Trainer(cfg, TINY)
    m = t.train_step(groups_from(t, n_groups=4))
    assert m["micro_batches"] >= 3
    assert m["mb_tokens_sum"] == m["tokens"], "a sum adds up over micro-batches"
    assert m["tokens"] / m["micro_batches"] <= m["mb_tokens_max"] < m["tokens"], "a max is the largest one"
    assert m["mb_tokens_max"] >= m["mb_tokens_mean"] >= m["tokens"] / m["micro_batches"], "a token-weighted mean"
    assert m["is_weight_max"] >= m["is_weight_mean"] > 0, "the built-in losses report their max as a max"


@pytest.mark.parametrize("prox", ["recompute", "loglinear"])
def test_several_updates_per_batch(prox):
    t = Trainer(LearnerConfig(updates_per_batch=2, micro_batch_tokens=64, prox=prox, lr=1e-3), TINY)
    m = t.train_step(groups_from(t, n_groups=4))
    assert m is not None and t.version == 2 and m["micro_batches"] >= 2
    assert m["max_lag"] == 0, "lag is measured against the policy that started the step"


def test_kl_term_and_reference_reset():
    cfg = dataclasses.replace(LearnerConfig(lr=3e-3), loss=LossConfig(kl_beta=0.1))
    t = Trainer(cfg, TINY)
    m0 = t.train_step(groups_from(t))
    assert m0["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference starts equal to the policy
    m1 = t.train_step(groups_from(t, seed=1, version=t.version))
    assert m1["kl"] > 0
    t.reset_reference()
    m2 = t.train_step(groups_from(t, seed=2, version=t.version))
    assert m2["kl"] == pytest.approx(0.0, abs=1e-6)


def test_only_the_loss_tokens_reach_the_output_head_and_the_step_is_that_of_scoring_every_position(monkeypatch):
    """The trainer scores the loss tokens alone; against a trainer whose log-probs and logits are cut from whole
    rows' (every position through the head, as before): the same loss, metrics and weights over steps that use the
    reference, the KL anchor's logits and a recomputed pi_prox, while the output head sees the loss tokens alone."""
    from policy.model import token_logprobs

    def from_whole_rows(model, input_ids, attention_mask, temperature, vocab, vision, banned, scored, shared=None):
        lp, logits = token_logprobs(model, input_ids, attention_mask, temperature, vocab, vision, banned)
        keep = torch.zeros(lp.numel(), dtype=torch.bool).index_fill(0, scored, True).view_as(lp)
        return lp * keep, logits[keep]

    cfg = LearnerConfig(lr=3e-3, updates_per_batch=2, prox="recompute", micro_batch_tokens=64,
                        loss=LossConfig(kl_beta=0.1), anchor=AnchorConfig(suite="sim:train:settings_display",
                                                                          samples=4))
    results = []
    for whole in (False, True):
        if whole:
            monkeypatch.setattr("learner.trainer.token_logprobs", from_whole_rows)
        t = Trainer(cfg, TINY, seed=0, anchor_demos=anchor_demos())
        rows, ms = [], []
        for s in range(2):
            groups = groups_from(t, seed=s, version=t.version)  # scores with the same model: not counted
            handle = t.net.module.get_output_embeddings().register_forward_hook(
                lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
            ms.append(t.train_step(groups))
            handle.remove()
        results.append((ms, rows, [p.detach().clone() for p in t.model.parameters()]))
    (scored, scored_rows, w_scored), (whole, whole_rows, w_whole) = results
    for a, b in zip(scored, whole):
        for key in ("loss", "pg_loss", "kl", "anchor_loss", "entropy", "clip_frac", "is_weight_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert scored[1]["kl"] > 0 and scored[1]["anchor_loss"] > 0
    for a, b in zip(w_scored, w_whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # per step: pi_prox recomputed over the RL micro-batches, then two updates, each over half of them and half of
    # the anchor's (the reference's passes run on its own copy of the model, whose head this hook is not on)
    loss_tokens = sum(2 * m["tokens"] + m["anchor_tokens"] for m in scored)
    assert sum(scored_rows) == loss_tokens, (scored_rows, scored)
    assert sum(whole_rows) > 3 * loss_tokens, "scoring whole rows, the head sees every position"


def _first_turns_shared(seed: int, n_groups: int = 3, g: int = 4) -> list:
    """Groups of two-turn rollouts: the first turns of a group share its prompt (of a different length per group),
    the outputs differ in length and have a token masked out of the loss; the second turns' prompts differ."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n_groups):
        prompt = rng.integers(0, 256, 24 + 9 * k).astype(np.int32)
        trajs = []
        for i in range(g):
            first = rng.integers(0, 256, 3 + 2 * i).astype(np.int32)
            loss_mask = np.ones(len(first), np.uint8)
            loss_mask[1] = 0
            second = rng.integers(0, 256, 4).astype(np.int32)
            turns = [P.TurnView(prompt, first, np.full(len(first), -3.0, np.float32), np.zeros(len(first), np.int32),
                                loss_mask, float(i % 2), False, "", ""),
                     P.TurnView(np.concatenate([prompt, first, rng.integers(0, 256, 5).astype(np.int32)]), second,
                                np.full(4, -3.0, np.float32), np.zeros(4, np.int32), np.ones(4, np.uint8),
                                float(i % 2), False, "", "")]
            trajs.append(P.Trajectory.from_turns(uuid.uuid4().hex[:8], float(i % 2), bool(i % 2), turns))
        out.append(P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id=f"sim:train/{k}",
                                     actor_id="a", trajectories=trajs, behavior_version_min=0,
                                     behavior_version_max=0))
    return out


def test_a_prompt_that_samples_share_runs_once_and_the_step_is_that_of_whole_rows():
    """A group's first turns begin with one prompt; with ``share_prompts`` each such prompt runs once per pass
    (the rows' continuations attend to its keys and values), and the steps are those of running every row whole:
    the same loss, KL to the reference, entropy, gradient norm and weights (temperature 0.7, a masked token, rows of
    different lengths). The embedding, in the policy's pass and the reference's, sees a shared micro-batch's prompt
    once and its rows' continuations, and the step counts the prompt tokens it did not run."""
    cfg = LearnerConfig(lr=1e-3, micro_batch_tokens=200, loss=LossConfig(kl_beta=0.1))
    results = {}
    for share in (False, True):
        t = Trainer(dataclasses.replace(cfg, share_prompts=share), TINY, seed=0, temperature=0.7)
        embedded, batches = [], []
        for model in (t.net.module, t.ref_model):
            model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: embedded.append(args[0].numel()))
        collated = t._rank_micro_batches
        t._rank_micro_batches = lambda samples: batches.extend(mbs := collated(samples)) or mbs
        ms = []
        for s in range(2):
            embedded.clear()
            batches.clear()
            m = t.train_step(_first_turns_shared(s))
            rows_run = sum(tb.shared.length + tb.input_ids[:, tb.shared.length:].numel() if tb.shared is not None
                           else tb.input_ids.numel() for tb in batches)
            assert sum(embedded) == 2 * rows_run, "each pass runs a shared prompt once"
            assert sum(tb.shared is not None for tb in batches) == (3 if share else 0)
            ms.append(m)
        results[share] = ms, [p.detach().clone() for p in t.model.parameters()]
    (whole, whole_params), (shared, shared_params) = results[False], results[True]
    for m_whole, m_shared in zip(whole, shared):
        assert m_whole["prompt_tokens_shared"] == 0
        # each group's 4 first turns: 3 prompts of 24, 33, 42 tokens not run
        assert m_shared["prompt_tokens_shared"] == 3 * (24 + 33 + 42)
        assert m_shared["tokens"] == m_whole["tokens"]
        for key in ("loss", "kl", "entropy", "grad_norm", "is_weight_mean"):
            assert m_shared[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(whole_params, shared_params):
        assert torch.allclose(a, b, atol=1e-5)
    # A checkpointed layer drops the KV cache in training, which the shared prompt's rows would attend to: off there.
    t = Trainer(dataclasses.replace(cfg, share_prompts=True, activation_checkpointing=True), TINY, seed=0,
                temperature=0.7)
    m = t.train_step(_first_turns_shared(0))
    assert m["prompt_tokens_shared"] == 0
    assert m["loss"] == pytest.approx(whole[0]["loss"], rel=1e-4, abs=1e-6)


def test_samples_of_one_prompt_go_together_within_the_token_budget():
    """Samples of one prompt go together, counting the prompt once (a VLM's: the same ids with the same images); a
    lone one, or one whose group no longer fits, is left for the length-sorted packing, in the given order; every
    sample is in exactly one micro-batch, and ``collate`` refuses to share a prompt the rows do not all begin
    with."""
    from learner.batch import Sample, collate, micro_batches, prompt_shares, share_one_prompt

    def sample(prompt, out_len, images=()):
        ids = np.concatenate([prompt, np.full(out_len, 7)]).astype(np.int64)
        z = np.zeros(out_len, np.float32)
        return Sample(ids, len(prompt), z, z.astype(np.int64), np.ones(out_len, np.float32), 1.0, "t", "x", 0,
                      images)

    a, b, c = np.arange(40), np.arange(40) + 1, np.arange(30)
    samples = ([sample(a, n) for n in (4, 5, 6, 7, 8)] + [sample(b, 3)] +
               # a VLM's: the same ids with other images (a screenshot of the same size) share nothing
               [sample(c, 4, images=("img",)), sample(c, 4, images=("other",))] +
               [sample(c[:0], 9), sample(c[:0], 9)] +  # no prompt at all: nothing to share
               [sample(c, 5, images=("img",))])
    shared, rest = prompt_shares(samples, max_tokens=64)
    mbs = shared + micro_batches(rest, max_tokens=64)
    assert sorted(id(s) for mb in mbs for s in mb) == sorted(id(s) for s in samples)
    assert [id(s) for s in rest] == [id(samples[i]) for i in (5, 7, 8, 9)], "the rest in given order"
    assert all(share_one_prompt(mb) for mb in shared)
    assert not any(share_one_prompt(mb) for mb in micro_batches(rest, 64))
    # prompt a: 40 + 3 rows x 6 = 58 fits 64, a fourth row (x 7) does not; then 7 and 8 together: 40 + 2 x 8 = 56;
    # prompt c with image "img": 30 + 2 x 5
    assert [[len(s.ids) - s.prompt_len for s in mb] for mb in shared] == [[4, 5, 6], [7, 8], [4, 5]]
    for mb in shared:
        tb = collate(mb, pad_id=0, share_prompt=True)
        assert tb.shared.length == mb[0].prompt_len and tb.shared.index.shape == tb.loss_index.shape
        assert int(tb.shared.index[0]) == 0, "a row's first sampled token is scored by the prompt's last position"
    with pytest.raises(ValueError, match="one prompt"):
        collate([samples[0], samples[5]], pad_id=0, share_prompt=True)
    with pytest.raises(ValueError, match="the same images"):
        collate([samples[6], samples[7]], pad_id=0, share_prompt=True)


def test_a_steps_reads_from_the_device_do_not_grow_with_its_micro_batches(monkeypatch):
    """On a GPU every read of a tensor (``float``, ``bool``, ``.item()``, a boolean index, ``.tolist()``) makes the host
    wait until the device has run all it was given, so a read per micro-batch stops the host from queuing ahead. A
    step's losses, metrics, finiteness and entropy stay on the device until its update's read or its end: the reads a
    step makes do not grow with its micro-batches, and none of them is of the kinds counted here (the previous trainer
    made 118 of those in a step of 4 micro-batches, 37 in a step of 1), a shared prompt's passes included. Its text rows
    are scored without an attention mask (right-padded, so causal attention alone is exact): the same log-probs as
    with it."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from learner.batch import collate, micro_batches
    from policy.model import token_logprobs

    waits = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
             "aten.masked_select.default", "aten.masked_scatter.default", "aten.unique.default",
             "aten._unique2.default", "aten.repeat_interleave.Tensor"}

    class CountWaits(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            bool_index = name == "aten.index.Tensor" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
            # the optimizer's step counts live on the CPU whatever the device: reading them waits for nothing
            if (name in waits or bool_index) and not any("torch/optim/" in f.filename
                                                         for f in traceback.extract_stack(limit=12)):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    cfg = LearnerConfig(lr=3e-3, updates_per_batch=2, prox="recompute", loss=LossConfig(kl_beta=0.1),
                        anchor=AnchorConfig(suite="sim:train:settings_display", samples=4))
    counted = {}
    for mb_tokens in (160, 40):  # two updates a step either way (their norms are read), 2 or 8 micro-batches
        t = Trainer(dataclasses.replace(cfg, micro_batch_tokens=mb_tokens), TINY, seed=0, anchor_demos=anchor_demos())
        t.train_step(groups_from(t, seed=0))
        groups = groups_from(t, seed=1, version=t.version, good=b"ok()", bad=b"fail(again)")  # padded rows
        # and a group whose rollouts share their prompt, run once (share_prompts)
        groups += groups_from(t, n_groups=1, seed=2, version=t.version, good=b"ok()", bad=b"fail(again)",
                              same_prompt=True)
        reads.clear()
        with CountWaits() as mode:
            m = t.train_step(groups)
        assert m["prompt_tokens_shared"] > 0
        counted[m["micro_batches"]] = (mode.seen, len(reads))
    (one, (seen_one, reads_one)), (many, (seen_many, reads_many)) = sorted(counted.items())
    assert 2 <= one < many, (one, many)
    assert seen_one == seen_many == [], (seen_one, seen_many)
    assert reads_one == reads_many <= 8, (reads_one, reads_many)

    samples, _ = build_samples(groups, t.cfg.advantage, t.tokenizer.vocab_size, t.version)
    tb = collate(micro_batches(samples, 1 << 14)[0], t.tokenizer.pad_id)
    assert len(set(tb.attention_mask.sum(-1).tolist())) > 1, "rows of several lengths, right-padded"
    with torch.no_grad():
        masked = token_logprobs(t.model, tb.input_ids, tb.attention_mask, scored=tb.loss_index)[0]
        unmasked = token_logprobs(t.model, tb.input_ids, None, scored=tb.loss_index)[0]
    torch.testing.assert_close(unmasked, masked, rtol=1e-5, atol=1e-5)
    assert (masked != 0).sum() == tb.num_tokens


def anchor_demos(n=6, answer=b"fail()") -> list:
    """Demonstration trajectories on their own prompts (bytes 100..119), all answering ``answer``."""
    out = []
    for k in range(n):
        prompt = np.arange(100, 120, dtype=np.int32)
        prompt[k] = 33  # distinct prompts
        ids = np.frombuffer(answer, np.uint8).astype(np.int32)
        turn = P.TurnView(prompt, ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32),
                          np.ones(len(ids), np.uint8), 1.0, False, "", answer.decode())
        out.append(P.Trajectory.from_turns(f"demo-{k}", 1.0, True, [turn]))
    return out


def test_step_metrics_do_not_depend_on_the_micro_batch_split():
    """The same step in one pass and in many: loss, its terms (the anchor's too) and the weights after it agree."""
    cfg = dataclasses.replace(LearnerConfig(lr=3e-3), loss=LossConfig(kl_beta=0.1),
                              anchor=AnchorConfig(suite="sim:train:settings_display", samples=6))
    results = []
    for mb_tokens in (1 << 14, 40):
        t = Trainer(dataclasses.replace(cfg, micro_batch_tokens=mb_tokens), TINY, seed=0,
                    anchor_demos=anchor_demos())
        t.train_step(groups_from(t, seed=0))  # moves the policy off its reference, so the KL is not 0
        m = t.train_step(groups_from(t, seed=1, version=t.version))
        results.append((m, [p.detach().clone() for p in t.model.parameters()]))
    (one, w_one), (many, w_many) = results
    assert one["micro_batches"] == 1 and many["micro_batches"] > 2
    assert one["kl"] > 0
    assert one["anchor_loss"] > 0
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "is_weight_mean", "anchor_loss"):
        assert many[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    assert one["loss"] == pytest.approx(one["pg_loss"] + 0.1 * one["kl"], rel=1e-4, abs=1e-7)
    for a, b in zip(w_one, w_many):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def demo_answer_logprob(trainer: Trainer, answer=b"fail()") -> float:
    ids = list(range(100, 120)) + list(answer)
    with torch.no_grad():
        return float(sequence_logprobs(trainer.model, torch.tensor([ids]))[0, 19:].sum())


def test_anchor_holds_the_policy_on_demonstrations_while_rl_moves_it_elsewhere(tmp_path):
    """A base policy cloned on the demos answers 'fail()' to their prompts; RL then pushes 'fail()' down on
    random prompts, which generalises to the demos' prompts unless an anchor replays them."""
    moved = {}
    base = None  # the base policy's checkpoint: cloned once, the same for every kind
    for kind in ("none", "kl", "sft"):
        anchor = AnchorConfig(suite="sim:train:settings_display", kind=kind, samples=4) if kind != "none" else AnchorConfig()
        t = Trainer(LearnerConfig(lr=3e-3, anchor=anchor), TINY, seed=0, anchor_demos=anchor_demos())
        if base is None:
            for _ in range(60):  # behaviour cloning makes the base policy (and the KL reference) know the demos
                t.sft_step(anchor_demos(), 3e-3)
            base = t.save(tmp_path / "base")
        else:
            t.load(base)
        t.reset_reference()
        before = demo_answer_logprob(t)
        assert before > -2.0
        for step in range(15):
            m = t.train_step(groups_from(t, seed=step, version=t.version))
        moved[kind] = demo_answer_logprob(t) - before
        assert ("anchor_loss" in m) == (kind != "none")
    assert moved["none"] < -10.0, moved  # unanchored, the demo answer is dragged down with 'fail()'
    assert abs(moved["kl"]) < 0.1 * abs(moved["none"]), moved
    assert abs(moved["sft"]) < 0.1 * abs(moved["none"]), moved


def test_anchor_configuration_errors():
    with pytest.raises(ValueError, match="no demonstrations"):
        Trainer(LearnerConfig(anchor=AnchorConfig(suite="sim:train:settings_display")), TINY)
    with pytest.raises(ValueError, match="kind must be kl or sft"):
        LearnerConfig(anchor=AnchorConfig(suite="sim:train", kind="ptx")).validate()


def test_entropulse_schedule_and_adaptive_transitions():
    e = Entropulse(EntropulseConfig(mode="schedule", rl_steps=3, sft_steps=2))
    phases = []
    for _ in range(3):
        phases.append(e.observe_rl(1.0, 0.5))
    assert phases == [None, None, "sft"] and e.phase == "sft"
    assert [e.observe_sft(), e.observe_sft()] == [None, "rl"] and e.phases_done == 1
    a = Entropulse(EntropulseConfig(mode="adaptive", min_rl_steps=4, entropy_drop=0.3, window=3, plateau_tol=0.05))
    out = []
    entropies = [2.0, 1.9, 1.8, 1.7, 1.5, 1.3, 1.2, 1.1, 1.0, 1.0]
    successes = [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    for ent, suc in zip(entropies, successes):
        out.append(a.observe_rl(ent, suc))
    # entropy's 3-step mean fell 30 % below the first three's by step 8, but success was still climbing; the
    # plateau shows at step 9
    assert out.index("sft") == 8, out
    saved = a.state_dict()
    b = Entropulse(a.cfg)
    b.load_state_dict(saved)
    assert b.state_dict() == saved and b.phase == "sft"
    c = Entropulse(EntropulseConfig(mode="adaptive", min_rl_steps=1, entropy_floor=0.5, entropy_drop=0, window=2))
    assert [c.observe_rl(0.4, s) for s in (0.2, 0.2, 0.2, 0.2)] == [None, None, None, "sft"]
    d = Entropulse(EntropulseConfig(mode="schedule", rl_steps=1, sft_steps=5))
    d.observe_rl(1.0, 0.5)
    d.skip_sft()
    assert d.phase == "rl" and d.phases_done == 1 and d.phase_step == 0
    d.skip_sft()
    assert d.phase == "rl" and d.phases_done == 1, "skipping outside an SFT phase changes nothing"
    off = Entropulse(EntropulseConfig(mode="off"))
    assert all(off.observe_rl(0.01, 0.9) is None for _ in range(500))
    # one batch's entropy at the phase's start is not its start: a spike in the first step, then flat entropy
    spike = Entropulse(EntropulseConfig(mode="adaptive", min_rl_steps=1, entropy_drop=0.3, window=5, plateau_tol=1.0))
    assert [spike.observe_rl(e, 0.5) for e in [3.0] + [1.0] * 14] == [None] * 15
    assert spike.entropy_at_start == pytest.approx(1.4) and spike.recent_entropy() == pytest.approx(1.0)
    # ... while a fall of the window means does switch, and the windows start afresh after the SFT phase
    fall = Entropulse(EntropulseConfig(mode="adaptive", min_rl_steps=1, entropy_drop=0.3, window=5, plateau_tol=1.0,
                                       sft_steps=1))
    assert [fall.observe_rl(e, 0.5) for e in [1.0] * 5 + [0.6] * 5].index("sft") == 9
    fall.observe_sft()
    assert fall.phase == "rl" and fall.entropy == [] and fall.entropy_at_start is None
    # resumed from a checkpoint saved before the window means (a start, no window): one low batch does not switch
    old = Entropulse(EntropulseConfig(mode="adaptive", min_rl_steps=1, entropy_drop=0.3, window=3, plateau_tol=1.0))
    old.load_state_dict({"phase": "rl", "phase_step": 10, "phases_done": 0, "entropy_at_start": 1.0,
                         "success": [0.5] * 6})
    assert [old.observe_rl(0.5, 0.5) for _ in range(3)] == [None, None, "sft"]


def test_checkpoint_resume_gives_the_identical_next_step(tmp_path):
    # with an sft anchor: its per-step draw of demo turns must also come out the same after the resume
    cfg = LearnerConfig(lr=1e-3, anchor=AnchorConfig(suite="sim:train:settings_display", kind="sft", samples=2))
    t = Trainer(cfg, TINY, anchor_demos=anchor_demos())
    t.train_step(groups_from(t, seed=0))
    t.train_step(groups_from(t, seed=1, version=t.version))
    path = t.save(tmp_path / "ck", {"note": "x"})
    nxt = groups_from(t, seed=2, version=t.version)
    m_a = t.train_step(nxt)
    r = Trainer(cfg, ModelConfig(**{**TINY.__dict__, "init_seed": 123}),  # different init: the checkpoint wins
                anchor_demos=anchor_demos())
    state = r.load(path)
    assert state["note"] == "x" and r.version == 2
    m_b = r.train_step(nxt)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-6, abs=1e-9) and r.version == t.version == 3
    assert m_b["anchor_loss"] == pytest.approx(m_a["anchor_loss"], rel=1e-6)
    for (n, p), (_, q) in zip(t.model.named_parameters(), r.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-7), n
    assert (tmp_path / "ck" / "latest").read_text() == path.name
    assert list(path.glob("*.safetensors")) and (path / "config.json").exists(), "HF format"


def test_a_damaged_checkpoint_is_found_before_a_resume_and_names_the_whole_one_before_it(tmp_path, quiet_log):
    """Found by hand (2026-12-03): a latest checkpoint cut short (a copy in part, a failing disk) made every learner
    start crash in torch.load; the supervisor restarted it 5 times, gave up and said the run was resumable with
    --resume, which crashed the same way."""
    import shutil

    from common.net import NetConfig
    from common.rundir import RunDir
    from learner import checkpoint as ckpt
    from launch.config import check_resumable

    t = Trainer(LearnerConfig(keep_checkpoints=5), TINY)
    first = t.save(tmp_path / "checkpoints")
    t.train_step(groups_from(t))
    latest = t.save(tmp_path / "checkpoints")
    assert ckpt.damage(first) == ckpt.damage(latest) == "" and check_resumable(tmp_path) is None
    pristine = tmp_path / "pristine"
    shutil.copytree(latest, pristine)
    weights = next(latest.glob("*.safetensors")).name
    cuts = {"trainer.pt": "trainer.pt: File is not a zip file", weights: f"{weights}: ",
            "state.json": "state.json: "}
    for name, said in cuts.items():
        data = (pristine / name).read_bytes()
        (latest / name).write_bytes(data[: len(data) // 2])
        assert ckpt.damage(latest).startswith(said), (name, ckpt.damage(latest))
        assert bool(ckpt.damage(latest, with_trainer=False)) == (name != "trainer.pt"), "eval reads no trainer.pt"
        with pytest.raises(ckpt.CheckpointDamaged) as refused:
            check_resumable(tmp_path)
        assert f"checkpoint {latest} is damaged: {said}" in str(refused.value)
        assert f"The newest whole one is {first.name}" in str(refused.value)
        assert f"echo {first.name} > {tmp_path / 'checkpoints' / 'latest'}" in str(refused.value)
        if name != "trainer.pt":
            from click.testing import CliRunner

            from launch.cli import main

            out = CliRunner().invoke(main, ["eval", "--checkpoint", str(tmp_path / "checkpoints"), "--episodes", "1"])
            assert out.exit_code == 1 and f"checkpoint {latest} is damaged: {said}" in out.output, out.output
        (latest / name).write_bytes(data)
    assert ckpt.damage(latest) == ""
    (latest / weights).write_bytes((pristine / weights).read_bytes() + b"x")
    assert "where its header says" in ckpt.damage(latest), "a longer file is not the one written either"
    # Found by hand (2026-12-04): the latest moved away, "latest" naming it, read as no checkpoint at all; --resume
    # said so and advised a new run in that directory, beside the whole one before it.
    moved = tmp_path / "moved"
    latest.rename(moved)
    for check in (check_resumable, lambda root: Learner(LearnerConfig(), TINY, None, NetConfig(), RunDir(root),
                                                         quiet_log, resume=True)):
        with pytest.raises(ckpt.CheckpointDamaged) as refused:
            check(tmp_path)
        assert f"latest names {latest.name}, which is not there (removed or moved?)" in str(refused.value)
        assert f"point latest at it: echo {first.name} > {tmp_path / 'checkpoints' / 'latest'}" in str(refused.value)
    # eval of the run's checkpoints/ says the same, as it says a damaged one or a directory holding no policy
    from click.testing import CliRunner

    from launch.cli import main

    (tmp_path / "empty").mkdir()
    for where, said in ((tmp_path / "checkpoints", f"latest names {latest.name}, which is not there"),
                        (tmp_path / "empty", f"--checkpoint {tmp_path / 'empty'}: model.path")):
        out = CliRunner().invoke(main, ["eval", "--checkpoint", str(where), "--episodes", "1"])
        assert out.exit_code == 1 and said in out.output and "Traceback" not in out.output, out.output
    moved.rename(latest)
    shutil.rmtree(first)
    with pytest.raises(ckpt.CheckpointDamaged, match="No checkpoint before it is whole"):
        ckpt.check_whole(latest)


def test_a_bit_changed_inside_a_checkpoint_is_found_by_the_resume_that_would_read_it(tmp_path, quiet_log):
    """A bit flipped inside a tensor (a failing disk, a bad copy) left every file its length, so the checks by length
    passed and a resume trained on from changed weights or optimizer moments without a word. Every checkpoint now
    records each file's length and CRC32 (``checksums.json``); the learner's resume, ``eval`` and ``replay-step``, which
    read every byte anyway, check them, and name the newest checkpoint whose bytes hold. A look at a run
    (``--resume``'s check before a submission, a sweep's state) reads lengths only. A checkpoint from before has no
    checksums and resumes as it did."""
    from click.testing import CliRunner

    from common.net import NetConfig
    from common.rundir import RunDir
    from learner import checkpoint as ckpt
    from launch.cli import main
    from launch.config import check_resumable

    t = Trainer(LearnerConfig(keep_checkpoints=5), TINY)
    first = t.save(tmp_path / "checkpoints")
    t.train_step(groups_from(t))
    second = t.save(tmp_path / "checkpoints")
    t.train_step(groups_from(t, seed=2, version=t.version))
    latest = t.save(tmp_path / "checkpoints")
    listed = json.loads((latest / ckpt.CHECKSUMS_FILE).read_text())["crc32"]
    assert {ckpt.TRAINER_FILE, ckpt.STATE_FILE, "config.json"} <= set(listed) and ckpt.CHECKSUMS_FILE not in listed
    assert ckpt.damage(latest, contents=True) == ""
    weights = next(latest.glob("*.safetensors"))
    flip = bytearray(second.joinpath(weights.name).read_bytes())
    flip[-7] ^= 0x10  # inside the last tensor: the file keeps its length and its header
    second.joinpath(weights.name).write_bytes(bytes(flip))
    for name in (weights.name, ckpt.TRAINER_FILE):
        data = (latest / name).read_bytes()
        (latest / name).write_bytes(data[:-9] + bytes([data[-9] ^ 0x01]) + data[-8:])
        said = f"{name}: its bytes changed since they were written"
        assert ckpt.damage(latest) == "" and check_resumable(tmp_path) is None, "by length it is whole"
        assert ckpt.damage(latest, contents=True).startswith(said)
        assert bool(ckpt.damage(latest, with_trainer=False, contents=True)) == (name != ckpt.TRAINER_FILE)
        with pytest.raises(ckpt.CheckpointDamaged) as refused:
            Learner(LearnerConfig(), TINY, None, NetConfig(), RunDir(tmp_path), quiet_log, resume=True)
        assert f"checkpoint {latest} is damaged: {said}" in str(refused.value)
        assert f"The newest whole one is {first.name}" in str(refused.value), "the one before is changed too"
        with pytest.raises(ckpt.CheckpointDamaged, match=said):  # (``replay-step``'s check)
            ckpt.resume_point(tmp_path / "checkpoints", contents=True)
        if name != ckpt.TRAINER_FILE:
            out = CliRunner().invoke(main, ["eval", "--checkpoint", str(latest), "--episodes", "1"])
            assert out.exit_code == 1 and said in out.output, out.output
        (latest / name).write_bytes(data)
    assert ckpt.damage(latest, contents=True) == ""
    # A checkpoint written before checksums: nothing to compare, so it resumes as it did.
    (latest / ckpt.CHECKSUMS_FILE).unlink()
    assert ckpt.resume_point(tmp_path / "checkpoints", contents=True) == latest
    (latest / ckpt.CHECKSUMS_FILE).write_text("{not json")
    assert ckpt.damage(latest, contents=True).startswith(f"{ckpt.CHECKSUMS_FILE}: unreadable")


def test_the_rotation_keeps_the_newest_checkpoints_and_never_the_one_just_written(tmp_path):
    """keep_checkpoints: the newest stay. A run resumed by hand from an older checkpoint (latest pointed back, the later
    ones left in place) writes versions lower than theirs, and with keep 1 each was deleted as it was written."""
    t = Trainer(LearnerConfig(keep_checkpoints=2), TINY)

    def saved(root):
        return sorted(p.name for p in root.glob("step-*"))
    for v in (1, 2, 3):
        t.version = v
        t.save(tmp_path / "plain")
    assert saved(tmp_path / "plain") == ["step-00000002", "step-00000003"]
    for keep, after in ((1, ["step-00000022"]), (2, ["step-00000022", "step-00000030"])):
        t.cfg = dataclasses.replace(t.cfg, keep_checkpoints=keep)
        root = tmp_path / f"keep-{keep}"
        t.version = 30  # left from before the rollback
        t.save(root)
        for v in (21, 22):
            t.version = v
            assert t.save(root).is_dir() and (root / "latest").read_text() == f"step-{v:08d}"
        assert saved(root) == after


def test_learner_process_loop_with_a_broker(start_broker, quiet_log, tmp_path):
    tb = start_broker(BrokerConfig(groups_per_batch=2, group_size=4, eta=2, persist=False))
    weights = WeightSyncConfig(port=free_port(), join_window_s=0.1, timeout_s=5.0)
    cfg = LearnerConfig(total_steps=3, checkpoint_every=2, lr=1e-3,
                        entropulse=EntropulseConfig(mode="schedule", rl_steps=2, sft_steps=1, k_per_task=2))
    learner = Learner(cfg, TINY, weights, tb.net, tb.run_dir, quiet_log)
    actor = ActorBrokerClient(tb.net, None, quiet_log)
    actor.connect(10)
    runner = threading.Thread(target=learner.run, daemon=True)
    runner.start()
    feeder = Trainer(LearnerConfig(), TINY)  # the same initial weights as the learner's
    fed = 0
    try:
        while runner.is_alive():
            actor.request_ticket()
            pump([actor], 2, until=lambda: bool(actor.tickets) or not runner.is_alive())
            while actor.tickets:
                t = actor.tickets.popleft()
                fed += 1
                g = groups_from(feeder, n_groups=1, seed=fed)[0]  # version-0 tokens: lag <= eta throughout
                g = dataclasses.replace(g, ticket_id=t.ticket_id, task_id=t.task_id)
                actor.submit(g)
            actor.poll(0.05)
        runner.join(10)
    finally:
        actor.close()
    assert learner.trainer.version == 3
    recs = [__import__("json").loads(x) for x in (tb.run_dir.metrics / "learner.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in recs][:3] == ["rl", "rl", "sft"]
    assert (tb.run_dir.checkpoints / "latest").exists()
    assert tb.broker.control.stop and tb.broker.control.weights is None, "told every role to stop"


def test_untrainable_batches_still_advance_the_version_without_new_weights(start_broker, quiet_log):
    """All-zero-variance batches (a policy that never succeeds yet) must not stall admission."""
    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=1, persist=False))
    cfg = LearnerConfig(total_steps=4, checkpoint_every=0)
    learner = Learner(cfg, TINY, None, tb.net, tb.run_dir, quiet_log)
    actor = ActorBrokerClient(tb.net, None, quiet_log)
    actor.connect(10)
    runner = threading.Thread(target=learner.run, daemon=True)
    runner.start()
    feeder = Trainer(LearnerConfig(), TINY)
    deadline = __import__("time").monotonic() + 60
    try:
        while runner.is_alive():
            assert __import__("time").monotonic() < deadline, "the learner stalled"
            if actor.outstanding_ticket_requests < 2:
                actor.request_ticket()
            actor.poll(0.1)
            while actor.tickets:
                t = actor.tickets.popleft()
                g = groups_from(feeder, n_groups=1, good=b"x", bad=b"x")[0]
                v = actor.version  # an actor relabels unchanged weights with the learner's version
                for tr in g.trajectories:  # everyone failed: zero variance
                    tr.reward, tr.success = 0.0, False
                    tr.turn_rewards[:] = 0.0
                    tr.versions[:] = v
                actor.submit(dataclasses.replace(g, ticket_id=t.ticket_id, task_id=t.task_id,
                                                 behavior_version_min=v, behavior_version_max=v))
        runner.join(10)
    finally:
        actor.close()
    assert learner.trainer.version == 4 and learner.trainer.content_version == 0
    assert learner.trainer.counters["empty_steps"] == 4
    assert tb.broker.control.content_version == 0


def feed_until(actor, done, seconds: float = 240.0, alter=None) -> None:
    """Answer ``actor``'s tickets with groups sampled by the learner's initial weights (version-0 tokens, so within
    any η for a few steps) until ``done()``; ``alter(n, group)``, where given, changes the ``n``-th group sent."""
    feeder = Trainer(LearnerConfig(), TINY)
    deadline = time.monotonic() + seconds
    n = 0
    while not done():
        assert time.monotonic() < deadline, "condition not met"
        if actor.outstanding_ticket_requests < 2:
            actor.request_ticket()
        actor.poll(0.05)
        while actor.tickets:
            t = actor.tickets.popleft()
            n += 1
            g = groups_from(feeder, n_groups=1, seed=n)[0]
            if alter is not None:
                alter(n, g)
            actor.submit(dataclasses.replace(g, ticket_id=t.ticket_id, task_id=t.task_id))


def _run_fed(learner: Learner, tb, log) -> list[BaseException]:
    """``learner``'s loop on a thread, an actor feeding it, until it ends; what it raised (what the process would
    exit with)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            learner.run()
        except BaseException as exc:
            failure.append(exc)

    actor = ActorBrokerClient(tb.net, None, log)
    actor.connect(10)
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        feed_until(actor, lambda: not runner.is_alive(), 90)
        runner.join(10)
    finally:
        actor.close()
    return failure


def _consumed_at_broker(tb) -> list[str]:
    import json

    lines = (tb.run_dir.audit / "broker.jsonl").read_text().splitlines()
    return [g for r in map(json.loads, lines) if r.get("e", r.get("event")) == "consumed" for g in r["gs"]]


def test_a_checkpoint_the_disk_refuses_commits_nothing_and_training_goes_on(start_broker, quiet_log, monkeypatch):
    """A save that fails (a full disk, a quota) is counted and logged; the learner trains on; nothing is committed
    for it, so its groups stay the broker's until the next checkpoint, which covers them and commits them all."""
    import learner.checkpoint as ckpt

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=True))
    learner = Learner(LearnerConfig(total_steps=3, checkpoint_every=1), TINY, None, tb.net, tb.run_dir, quiet_log)
    real_save, saves, committed = ckpt.save, [], []

    def second_fails(root, version, *args, **kw):
        saves.append(version)
        if len(saves) == 2:
            raise OSError(28, "No space left on device")
        return real_save(root, version, *args, **kw)

    monkeypatch.setattr(ckpt, "save", second_fails)
    real_durable = learner.client.checkpoint_durable
    learner.client.checkpoint_durable = lambda v: (committed.append(v), real_durable(v))[1]
    assert _run_fed(learner, tb, quiet_log) == []
    assert saves == [1, 2, 3] and committed == [1, 3], "the failed checkpoint committed nothing"
    assert learner.trainer.counters["checkpoints_failed"] == 1
    assert len(_consumed_at_broker(tb)) == 3, "step 2's group committed with step 3's checkpoint"
    assert not list(tb.run_dir.checkpoints.glob(".tmp-*")), "no half-written checkpoint left holding space"


@pytest.mark.parametrize("room_kib", [16, 320])
def test_a_really_full_disk_refuses_a_checkpoint_as_an_oserror_and_leaves_no_half_of_it(tmp_path, room_kib):
    """Found on a whole run whose directory filled up (2026-12-03): torch.save says a full disk with a RuntimeError
    ("unexpected pos"), safetensors with a SafetensorError, so the learner's catch of OSError missed both, and each
    periodic checkpoint crashed it; its restarts trained the same steps again until the supervisor gave up. A tmpfs
    too small for the weights (16 KiB) fails in safetensors, one that takes them but not the optimizer (320 KiB)
    in torch.save."""
    import subprocess

    from learner.checkpoint import StorageRefused

    disk = tmp_path / "checkpoints"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room_kib}k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        t = Trainer(LearnerConfig(), TINY)
        t.train_step(groups_from(t))  # an optimizer with state to save
        with pytest.raises(StorageRefused) as refused:
            t.save(disk)
        assert refused.value.errno == errno.ENOSPC, refused.value
        assert f"step-{t.version:08d} not written to {disk}: No space left on device" in str(refused.value)
        assert list(disk.iterdir()) == [], "no half-written checkpoint left holding space"
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert t.save(disk).name == f"step-{t.version:08d}"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_final_checkpoint_the_disk_refuses_ends_the_learner_with_an_error_and_leaves_the_run_up(
        start_broker, quiet_log, monkeypatch):
    """The checkpoint taken on the way out cannot be skipped: after the last step it is tried again for
    ``final_checkpoint_wait_s``, then the learner stops with ``CheckpointFailed`` (a supervisor restarts it, and it
    trains the lost steps again), and it does not tell the run to stop."""
    import learner.checkpoint as ckpt
    import learner.process as process
    from learner.process import CheckpointFailed

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=True))
    learner = Learner(LearnerConfig(total_steps=2, checkpoint_every=0, final_checkpoint_wait_s=0.5), TINY, None,
                      tb.net, tb.run_dir, quiet_log)

    tries: list[float] = []

    def full_disk(*args, **kw):
        tries.append(time.monotonic())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save", full_disk)
    monkeypatch.setattr(process, "FINAL_CHECKPOINT_RETRY_S", 0.1)
    (failure,) = _run_fed(learner, tb, quiet_log)
    assert isinstance(failure, CheckpointFailed) and "version 2" in str(failure)
    # Tried every 0.1 s for 0.5 s. (By times, not a count: a count of 4 or more failed once under load, each try's
    # round trip through the training thread taking longer than its wait.)
    assert learner.trainer.counters["checkpoints_failed"] == len(tries) <= 7
    assert tries[-1] - tries[0] >= 0.5 - 1e-3, "tried until the wait ran out"
    assert all(b - a >= 0.1 - 1e-3 for a, b in zip(tries, tries[1:-1])), "not more often than every 0.1 s"
    assert not tb.broker.control.stop, "the run stays up for a restarted learner"
    assert _consumed_at_broker(tb) == [], "nothing committed"


def test_a_resumed_learner_counts_its_checkpoint_durable(start_broker, quiet_log, monkeypatch):
    """A resumed learner whose next checkpoint the disk refused logged ``last_durable: null`` (seen on a whole run,
    2026-12-04), as if nothing were durable; the checkpoint it resumed from is."""
    import learner.checkpoint as ckpt

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=True))
    assert _run_fed(Learner(LearnerConfig(total_steps=1, checkpoint_every=0), TINY, None, tb.net, tb.run_dir,
                            quiet_log), tb, quiet_log) == []
    events: list[tuple[str, dict]] = []

    class Recording:
        def __getattr__(self, level):
            return lambda event, **kw: events.append((event, kw))
    tb.broker.control.stop = False  # (the first learner ended the run; this one goes on with it)
    resumed = Learner(LearnerConfig(total_steps=3, checkpoint_every=1, final_checkpoint_wait_s=0), TINY, None, tb.net,
                      tb.run_dir, Recording(), resume=True)

    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "save", full_disk)
    _run_fed(resumed, tb, quiet_log)
    failed = [kw for event, kw in events if event == "checkpoint_failed"]
    assert failed and all(kw["last_durable"] == 1 for kw in failed), failed


def test_a_final_checkpoint_that_fits_once_space_returns_ends_the_run(start_broker, quiet_log, monkeypatch):
    """Found on a whole run whose disk filled (2026-12-03): a learner that stopped at its refused final checkpoint was
    restarted from its last durable one, and every periodic checkpoint had failed on that disk too, so it trained most
    of the run again. Waiting for space, it finishes the run with the steps it has."""
    import learner.checkpoint as ckpt
    import learner.process as process

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=True))
    learner = Learner(LearnerConfig(total_steps=2, checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    real_save, saves = ckpt.save, []

    def full_twice(root, version, *args, **kw):
        saves.append(version)
        if len(saves) <= 2:
            raise OSError(28, "No space left on device")
        return real_save(root, version, *args, **kw)

    monkeypatch.setattr(ckpt, "save", full_twice)
    monkeypatch.setattr(process, "FINAL_CHECKPOINT_RETRY_S", 0.1)
    assert _run_fed(learner, tb, quiet_log) == []
    assert saves == [2, 2, 2] and learner.trainer.counters["checkpoints_failed"] == 2
    assert tb.broker.control.stop, "the run is over"
    assert len(_consumed_at_broker(tb)) == 2, "both steps' groups committed"


def test_a_batch_that_makes_a_step_raise_is_dropped_and_three_in_a_row_stop_the_learner(start_broker, quiet_log):
    """A batch whose step raises (a bug its data reaches) is dropped, its groups settled as ``step_failed`` and
    counted, and training goes on: restarting would only get it delivered again, and fail again. Three steps in a
    row that raise stop the learner with the error: nothing can be trained."""
    import json

    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=False))
    learner = Learner(LearnerConfig(total_steps=3, checkpoint_every=0), TINY, None, tb.net, tb.run_dir, quiet_log)
    real, calls = learner.trainer.train_step, []

    def second_one_raises(groups, eta=None):
        calls.append([g.group_id for g in groups])
        if len(calls) == 2:
            raise ZeroDivisionError("float division by zero")
        return real(groups, eta)

    learner.trainer.train_step = second_one_raises
    assert _run_fed(learner, tb, quiet_log) == []
    assert learner.trainer.version == 3 and len(calls) == 3
    counters = learner.trainer.counters
    assert counters["steps_failed"] == 1 and counters["groups_dropped_step_failed"] == 1
    audit = [json.loads(x) for x in (tb.run_dir.audit / "learner.jsonl").read_text().splitlines()]
    assert [e["g"] for e in audit if e["e"] == "dropped" and e["r"] == "step_failed"] == calls[1]
    assert [g for e in audit if e["e"] == "trained" for g in e["gs"]] == calls[0] + calls[2]

    tb2 = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=False))
    learner = Learner(LearnerConfig(total_steps=5, checkpoint_every=0), TINY, None, tb2.net, tb2.run_dir, quiet_log)

    def always_raises(groups, eta=None):
        raise ValueError("a broken device")

    learner.trainer.train_step = always_raises
    failure = _run_fed(learner, tb2, quiet_log)
    assert [type(e) for e in failure] == [ValueError] and learner.trainer.counters["steps_failed"] == 2


def test_a_step_that_raises_after_its_update_stops_the_learner(start_broker, quiet_log):
    """A step that raised once its update was made (here in gathering the weights for the actors) trained its groups:
    they cannot be settled as dropped, so the error stops the learner, as before."""
    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=False))
    learner = Learner(LearnerConfig(), TINY, None, tb.net, tb.run_dir, quiet_log)
    groups = groups_from(learner.trainer, n_groups=1)
    batch = P.Batch(batch_id="b0", train_version=0, groups=groups, max_lag=0, mean_lag=0.0, dropped_stale=0)

    def broken_gather():
        raise RuntimeError("NCCL error")

    learner.trainer.gather_weights = broken_gather
    with pytest.raises(RuntimeError, match="NCCL error"):
        learner._step("rl", {"eta": 2}, batch, [g.group_id for g in groups])
    assert learner.trainer.version == 1 and "steps_failed" not in learner.trainer.counters
    learner.close()


def test_an_sft_step_that_raises_is_skipped_like_an_rl_steps_batch(start_broker, quiet_log):
    """An SFT step on stored successes that raises before its update is skipped, counted and logged; it settles no
    group (stored successes are no broker groups); the next step goes on."""
    tb = start_broker(BrokerConfig(groups_per_batch=1, group_size=4, eta=2, persist=False))
    learner = Learner(LearnerConfig(), TINY, None, tb.net, tb.run_dir, quiet_log)
    successes = P.SuccessBatch(samples=[P.SuccessSample(task_id="t", trajectory=groups_from(learner.trainer)[0]
                                                        .trajectories[0])])
    real = learner.trainer.sft_step

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    learner.trainer.sft_step = out_of_memory
    m = learner._step("sft", {"lr": 1e-3}, successes)
    assert "empty" in m and m["outcomes"] == {} and learner.trainer.counters["steps_failed"] == 1
    assert "groups_dropped_step_failed" not in learner.trainer.counters
    learner.trainer.sft_step = real
    assert "empty" not in learner._step("sft", {"lr": 1e-3}, successes) and learner.trainer.version == 1
    learner.close()


def test_a_step_that_raised_midway_leaves_no_gradient_to_the_next():
    """With a bf16 compute copy the gradients of a pass stay on the copy until the update moves them: a step that
    raised after a backward must not leave them for the next step's backward to add to."""
    cfg = LearnerConfig(lr=1e-3, micro_batch_tokens=64)
    bf16 = ModelConfig(**{**TINY.__dict__, "dtype": "bfloat16"})
    broken, clean = Trainer(cfg, bf16), Trainer(cfg, bf16)
    first, second = groups_from(broken, seed=1), groups_from(broken, seed=2)
    passes = []
    real = broken._loss_inputs

    def raising_at_the_second_pass(*args, **kwargs):
        passes.append(1)
        if len(passes) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    broken._loss_inputs = raising_at_the_second_pass
    with pytest.raises(RuntimeError, match="out of memory"):
        broken.train_step(first)
    assert any(p.grad is not None for p in broken.net.module.parameters()), "the first pass's gradients are left"
    broken.drop_gradients()
    broken._loss_inputs = real
    m_broken, m_clean = broken.train_step(second), clean.train_step(second)
    assert m_broken["grad_norm"] == pytest.approx(m_clean["grad_norm"], rel=1e-6)
    for a, b in zip(broken.model.parameters(), clean.model.parameters()):
        assert torch.equal(a, b)


def test_bf16_compute_keeps_float32_master_weights_so_small_updates_are_not_rounded_away(tmp_path):
    # At lr 1e-6 a bf16 weight (8 mantissa bits) cannot move: 1e-6 is far below half its spacing. The
    # masters are float32 and take the update; the bf16 copy the passes run on follows them.
    cfg = LearnerConfig(lr=1e-6, grad_clip=0.0)
    t = Trainer(cfg, ModelConfig(**{**TINY.__dict__, "dtype": "bfloat16"}))
    assert t.compute_dtype == torch.bfloat16 and t.net.module is not t.model
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(p.dtype == torch.bfloat16 for _, p in t.net.named_parameters())
    # an engine building the same seeded model in bf16 holds version 0 exactly as the learner's compute copy
    engine_side = build_model(ModelConfig(**{**TINY.__dict__, "dtype": "bfloat16"}), t.model.config.vocab_size)
    for (n, mine), (_, theirs) in zip(t.net.named_parameters(), engine_side.named_parameters()):
        assert torch.equal(mine.detach(), theirs.detach()), n
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    pure = {n: p.detach().to(torch.bfloat16) for n, p in t.model.named_parameters()}
    m = t.train_step(groups_from(t))
    assert m is not None and m["grad_norm"] > 0
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in t.model.named_parameters()}
    assert all(v > 0 for v in moved.values()), "every master tensor took the update"
    # what a bf16-only optimizer would hold: the same update applied in bf16 leaves most weights where they were
    w = pure["model.layers.0.mlp.up_proj.weight"]
    assert float((w + torch.full_like(w, 1e-6) == w).float().mean()) > 0.9
    for (n, low), (_, master) in zip(t.net.named_parameters(), t.model.named_parameters()):
        assert torch.equal(low.detach(), master.detach().to(torch.bfloat16)), n
    # the weights actors get are the compute copy (half the bytes); checkpoints hold the float32 masters
    assert all(p.dtype == torch.bfloat16 for _, p in t.weights_for_broadcast())
    path = t.save(tmp_path / "ck")
    r = Trainer(cfg, ModelConfig(**{**TINY.__dict__, "dtype": "bfloat16", "init_seed": 5}))
    r.load(path)
    for (n, p), (_, q) in zip(t.model.named_parameters(), r.model.named_parameters()):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip(t.net.named_parameters(), r.net.named_parameters()):
        assert torch.equal(p, q), n


def test_a_bad_loss_or_estimator_name_fails_when_the_learner_starts():
    for cfg in (dataclasses.replace(LearnerConfig(), loss=LossConfig(name="nope_pkg.mod:fn")),
                dataclasses.replace(LearnerConfig(), advantage=AdvantageConfig(name="nope_pkg.mod:fn"))):
        with pytest.raises(ValueError, match="cannot load 'nope_pkg.mod:fn'"):
            Trainer(cfg, TINY)


def test_a_failed_or_short_weight_round_is_sent_again_with_back_off():
    """Actors that missed a round stay on old weights; if the next steps are empty no round would follow, and
    their groups would all go stale (a real-desktop run stalled that way): the learner sends the round again."""
    import types

    from policy.weightsync import RoundFailed
    from learner.process import ROUND_RETRY_MAX_S, Learner

    outcomes = [RoundFailed("peer closed"), 1, 2, RoundFailed("again")]

    class Sender:
        def broadcast(self, named, version, expected):
            out = outcomes.pop(0)
            if isinstance(out, Exception):
                raise out
            return out

    counts: dict = {}
    learner = object.__new__(Learner)
    learner.cfg = types.SimpleNamespace(expected_actors=2)
    learner.sender = Sender()
    learner.trainer = types.SimpleNamespace(weights_for_broadcast=lambda: [], version=5,
                                            _count=lambda k, n=1: counts.__setitem__(k, counts.get(k, 0) + n))
    learner._round_failures, learner._retry_round_at = 0, 0.0
    t0 = time.monotonic()
    learner._broadcast()  # failed: again in 2 s
    assert learner._round_failures == 1 and 1.5 < learner._retry_round_at - t0 < 2.5
    learner._broadcast()  # one of two actors received it: again in 4 s
    assert learner._round_failures == 2 and 3.5 < learner._retry_round_at - t0 < 4.5
    learner._retry_round_at = 0.0
    learner._broadcast()  # both received it: nothing to retry
    assert learner._round_failures == 0 and learner._retry_round_at == 0.0
    learner._round_failures = 10
    learner._broadcast()
    assert learner._retry_round_at - time.monotonic() <= ROUND_RETRY_MAX_S
    assert counts == {"weight_rounds_failed": 2, "weight_receivers": 3}
