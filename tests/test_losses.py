"""Every built-in loss and advantage estimator against an independent computation (plain Python loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from learner import advantages as ADV  # noqa: E402
from learner.losses import (LossConfig, LossInputs, anchor_kl_term, anchor_sft_term, explored_sft_term,  # noqa: E402
                            get_loss, grpo_loss, k3_kl, kl_term)


def make_inputs(seed=0, n=4, t=6, spread=0.6, ref=True):
    rng = np.random.default_rng(seed)
    behav = -rng.random((n, t)) * 2 - 0.1
    prox = behav + rng.normal(0, spread, (n, t))
    theta = prox + rng.normal(0, 0.3, (n, t))
    mask = (rng.random((n, t)) > 0.2).astype(np.float64)
    mask[:, 0] = 1
    adv = np.repeat(rng.normal(0, 1, (n, 1)), t, axis=1)
    refl = theta + rng.normal(0, 0.2, (n, t))
    T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    inp = LossInputs(T(theta).requires_grad_(), T(prox), T(behav), T(adv), T(mask), float(mask.sum()),
                     T(refl) if ref else None)
    return inp, dict(theta=theta, prox=prox, behav=behav, mask=mask, adv=adv, ref=refl)


def reference_grpo(d, eps_low, eps_high, w_max, w_mode, w_level, beta):
    n, t = d["mask"].shape
    total = d["mask"].sum()
    loss = 0.0
    for i in range(n):
        seq_log_w = sum((d["prox"][i, j] - d["behav"][i, j]) for j in range(t) if d["mask"][i, j])
        for j in range(t):
            if not d["mask"][i, j]:
                continue
            if beta:  # the KL term applies to every loss token, truncated or not
                dd = d["ref"][i, j] - d["theta"][i, j]
                loss += beta * (math.exp(dd) - dd - 1)
            log_w = seq_log_w if w_level == "sequence" else d["prox"][i, j] - d["behav"][i, j]
            w = math.exp(log_w)
            if w_mode == "mask" and w > w_max:
                continue
            if w_mode == "clamp":
                w = min(w, w_max)
            u = math.exp(d["theta"][i, j] - d["prox"][i, j])
            a = d["adv"][i, j]
            loss -= w * min(u * a, min(max(u, 1 - eps_low), 1 + eps_high) * a)
    return loss / total


@pytest.mark.parametrize("w_mode", ["mask", "clamp", "off"])
@pytest.mark.parametrize("w_level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_matches_an_independent_computation(w_mode, w_level, beta):
    for seed in range(3):
        inp, d = make_inputs(seed)
        cfg = LossConfig(eps_low=0.2, eps_high=0.28, w_max=1.5, w_mode=w_mode, w_level=w_level, kl_beta=beta)
        out = grpo_loss(inp, cfg)
        total = out.loss + beta * kl_term(inp, cfg).loss  # the objective: the policy term plus the KL term
        want = reference_grpo(d, 0.2, 0.28, 1.5, w_mode, w_level, beta)
        assert total.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert "is_masked_frac" in out.metrics and "clip_frac" in out.metrics


def test_truncation_actually_bites_and_clip_boundaries():
    inp, d = make_inputs(1, spread=1.5)
    masked = grpo_loss(inp, LossConfig(w_max=1.2, w_mode="mask"))
    assert 0 < masked.metrics["is_masked_frac"] < 1
    # At the clip boundaries: with A > 0 a ratio above 1 + eps_high stops moving the loss; below it still does.
    for u, a, moves in [(1.5, 1.0, False), (1.1, 1.0, True), (0.5, -1.0, False), (0.9, -1.0, True)]:
        theta = torch.tensor([[math.log(u)]], dtype=torch.float64, requires_grad=True)
        zero = torch.zeros((1, 1), dtype=torch.float64)
        x = LossInputs(theta, zero, zero, torch.tensor([[a]], dtype=torch.float64),
                       torch.ones((1, 1), dtype=torch.float64), 1.0)
        grpo_loss(x, LossConfig(eps_low=0.2, eps_high=0.28)).loss.backward()
        assert (theta.grad.abs().item() > 0) == moves, (u, a)


def test_decoupled_grpo_with_prox_equal_behaviour_is_plain_clipped_grpo():
    inp, d = make_inputs(2)
    inp.prox_logprobs = inp.behav_logprobs.clone()
    out = grpo_loss(inp, LossConfig(w_mode="mask", w_max=1.0))
    u = torch.exp(inp.logprobs - inp.behav_logprobs)
    plain = -(torch.minimum(u * inp.advantages, u.clamp(0.8, 1.28) * inp.advantages) * inp.mask).sum() / inp.num_tokens
    assert out.loss.item() == pytest.approx(plain.item(), rel=1e-12)
    assert out.metrics["is_masked_frac"] == 0 and out.metrics["is_weight_mean"] == pytest.approx(1.0)


def test_ppo_reinforce_sft_and_k3():
    inp, d = make_inputs(3)
    ppo = get_loss("ppo")(inp, LossConfig(eps_low=0.2, w_mode="off"))
    assert ppo.loss.item() == pytest.approx(reference_grpo(d, 0.2, 0.2, 1e9, "off", "token", 0.0), rel=1e-9)
    rf = get_loss("reinforce")(inp, LossConfig(w_mode="off"))
    want = -sum(math.exp(d["prox"][i, j] - d["behav"][i, j]) * math.exp(d["theta"][i, j] - d["prox"][i, j])
                * d["adv"][i, j] for i in range(4) for j in range(6) if d["mask"][i, j]) / d["mask"].sum()
    assert rf.loss.item() == pytest.approx(want, rel=1e-9)
    sft = get_loss("sft")(inp, LossConfig())
    assert sft.loss.item() == pytest.approx(-(d["theta"] * d["mask"]).sum() / d["mask"].sum(), rel=1e-12)
    x, r = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    p, q = torch.exp(x), torch.exp(r)
    assert torch.allclose(k3_kl(x, r), q / p - torch.log(q / p) - 1)
    assert (k3_kl(x, x) == 0).all()
    with pytest.raises(ValueError, match="import path"):
        get_loss("nonexistent")


def test_group_advantages_trajectory_and_step_level():
    g = ADV.GroupRewards("t", [1.0, 0.0, 1.0, 0.0], [[1.0, 1.0], [0.0], [1.0, 0.0, 1.0], [0.0, 0.0]])
    cfg = ADV.AdvantageConfig()
    adv = ADV.compute([g], cfg)[0]
    assert [len(a) for a in adv] == [2, 1, 3, 2]
    assert adv[0][0] == pytest.approx((1 - 0.5) / (0.5 + 1e-6)) and adv[1][0] == pytest.approx(-0.5 / (0.5 + 1e-6))
    dr = ADV.compute([g], ADV.AdvantageConfig(std=False))[0]
    assert dr[0] == [0.5, 0.5] and dr[1] == [-0.5]
    step = ADV.compute([g], ADV.AdvantageConfig(level="step"))[0]
    flat = [1, 1, 0, 1, 0, 1, 0, 0]
    m = sum(flat) / 8
    s = math.sqrt(sum((x - m) ** 2 for x in flat) / 8)
    assert step[2] == pytest.approx([(1 - m) / (s + 1e-6), (0 - m) / (s + 1e-6), (1 - m) / (s + 1e-6)])
    same = ADV.GroupRewards("t", [1.0, 1.0], [[1.0], [1.0]])
    assert ADV.zero_variance(same, cfg) and not ADV.zero_variance(g, cfg)
    assert ADV.compute([same], cfg)[0] == [[0.0], [0.0]]


def test_rloo_batch_and_per_task():
    g1 = ADV.GroupRewards("a", [1.0, 0.0, 0.5], [[1.0], [0.0], [0.5]])
    g2 = ADV.GroupRewards("b", [0.0, 0.0, 1.0], [[0.0], [0.0], [1.0]])
    r = ADV.compute([g1], ADV.AdvantageConfig(name="rloo"))[0]
    assert [x[0] for x in r] == pytest.approx([1 - 0.25, 0 - 0.75, 0.5 - 0.5])
    b = ADV.compute([g1, g2], ADV.AdvantageConfig(name="batch"))
    allr = [1, 0, 0.5, 0, 0, 1]
    m = sum(allr) / 6
    s = math.sqrt(sum((x - m) ** 2 for x in allr) / 6)
    assert b[1][2][0] == pytest.approx((1 - m) / (s + 1e-6))
    pt = ADV.compute([g1, g2, g2], ADV.AdvantageConfig(std=False, per_task=True))
    vals = [x for traj in pt[1] + pt[2] for x in traj]
    assert sum(vals) == pytest.approx(0, abs=1e-9) and np.std(vals) == pytest.approx(1, rel=1e-3)


def test_negative_weight_scales_only_negative_advantages():
    g = ADV.GroupRewards("t", [1.0, 0.0, 0.0, 0.0], [[1.0, 1.0], [0.0], [0.0], [0.0, 0.0]])
    full = ADV.compute([g], ADV.AdvantageConfig(std=False))[0]
    assert full == [[0.75, 0.75], [-0.25], [-0.25], [-0.25, -0.25]]
    assert ADV.compute([g], ADV.AdvantageConfig(std=False, negative_weight=0.0))[0] == \
        [[0.75, 0.75], [0.0], [0.0], [0.0, 0.0]]
    half = ADV.compute([g], ADV.AdvantageConfig(name="rloo", negative_weight=0.5))[0]
    assert [a[0] for a in half] == pytest.approx([1.0, -1 / 6, -1 / 6, -1 / 6])
    with pytest.raises(ValueError, match="negative_weight"):
        ADV.AdvantageConfig(negative_weight=1.5).validate()


def test_trajectory_weighting_gives_every_trajectory_the_same_weight():
    import time
    import uuid

    from common import protocol as P
    from learner.batch import build_samples
    from tests.conftest import make_traj

    # A short success (1 turn of 5 tokens) against a long failure (4 turns of 9 tokens) and a mid one.
    trajs = [make_traj(reward=1.0, turns=1, out_len=5, seed=1), make_traj(reward=0.0, turns=4, out_len=9, seed=2),
             make_traj(reward=0.0, turns=2, out_len=7, seed=3)]
    group = P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id="sim:train/0", actor_id="a",
                              trajectories=trajs, behavior_version_min=0, behavior_version_max=0,
                              created_at=time.monotonic(), complete=True)

    def weight_per_traj(weighting):
        samples, _ = build_samples([group], ADV.AdvantageConfig(weighting=weighting), 256, 0)
        out: dict[str, float] = {}
        for s in samples:
            out[s.traj_id] = out.get(s.traj_id, 0.0) + s.advantage * float(s.loss_mask.sum())
        return [out[t.traj_id] for t in trajs]

    per_token = weight_per_traj("token")
    # Counted per token, the long failure outweighs the success that the group's advantages balance it against.
    assert abs(per_token[1]) > 3 * abs(per_token[0]) and sum(per_token) < -20
    per_traj = weight_per_traj("trajectory")
    base = ADV.compute([ADV.GroupRewards("t", [1.0, 0.0, 0.0], [[1.0], [0.0] * 4, [0.0] * 2])],
                       ADV.AdvantageConfig())[0]
    mean_tokens = (5 + 36 + 14) / 3
    assert per_traj == pytest.approx([base[0][0] * mean_tokens, base[1][0] * mean_tokens, base[2][0] * mean_tokens])
    assert sum(per_traj) == pytest.approx(0, abs=1e-6), "the group's advantages cancel on shared tokens again"
    with pytest.raises(ValueError, match="weighting"):
        ADV.AdvantageConfig(weighting="sample").validate()
    # A trajectory whose every token is masked out of the loss (the wire allows it) counts for nothing, and the
    # others are weighed among themselves: no division by its zero tokens (it took the learner down, found by
    # tests/test_learner_differential.py).
    trajs[2].loss_mask[:] = 0
    masked = weight_per_traj("trajectory")
    mean_tokens = (5 + 36) / 2
    assert masked == pytest.approx([base[0][0] * mean_tokens, base[1][0] * mean_tokens, 0.0])



def test_the_kl_term_needs_reference_logprobs_and_matches_an_independent_computation():
    inp, d = make_inputs(ref=False)
    with pytest.raises(ValueError, match="reference log-probs"):
        kl_term(inp, LossConfig(kl_beta=0.1))
    inp, d = make_inputs(ref=True)
    out = kl_term(inp, LossConfig())
    want = sum(math.exp(d["ref"][i, j] - d["theta"][i, j]) - (d["ref"][i, j] - d["theta"][i, j]) - 1
               for i in range(4) for j in range(6) if d["mask"][i, j]) / d["mask"].sum()
    assert out.loss.item() == pytest.approx(want, rel=1e-9) and out.metrics["kl"] == pytest.approx(want, rel=1e-9)
    assert kl_term.needs == {"ref_logprobs"}
    for name in ("grpo", "ppo", "reinforce"):  # a policy loss is only the policy term: KL is the objective's
        with_beta = get_loss(name)(inp, LossConfig(kl_beta=0.5)).loss.item()
        assert with_beta == pytest.approx(get_loss(name)(inp, LossConfig()).loss.item(), rel=1e-12), name


def test_anchor_terms_match_an_independent_computation():
    rng = np.random.default_rng(7)
    n, t, v = 2, 3, 5
    logits, ref_logits = rng.normal(0, 1, (n, t, v)), rng.normal(0, 1, (n, t, v))
    mask = np.array([[1, 1, 0], [1, 0, 1]], dtype=np.float64)
    targets = rng.integers(0, v, (n, t))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lp = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    zeros = T(np.zeros((n, t)))
    loss_tokens = T(mask) > 0  # the trainer passes the loss tokens' logits alone, row-major
    inp = LossInputs(T(lp), zeros, zeros, zeros, T(mask), 10.0, logits=T(logits)[loss_tokens],
                     ref_logits=T(ref_logits)[loss_tokens], logits_mask=T(mask)[loss_tokens])
    kl = 0.0
    for i in range(n):
        for j in range(t):
            if mask[i, j]:
                q = np.exp(ref_logits[i, j]) / np.exp(ref_logits[i, j]).sum()
                p = np.exp(logits[i, j]) / np.exp(logits[i, j]).sum()
                kl += sum(q[k] * (math.log(q[k]) - math.log(p[k])) for k in range(v))
    out = anchor_kl_term(inp, LossConfig())
    assert out.loss.item() == pytest.approx(kl / 10.0, rel=1e-6)  # computed in float32 by design
    assert out.metrics["anchor_loss"] == pytest.approx(kl / mask.sum(), rel=1e-6)
    assert anchor_kl_term.needs == {"logits", "ref_logits"}
    nll = -sum(lp[i, j] for i in range(n) for j in range(t) if mask[i, j])
    assert anchor_sft_term(inp, LossConfig()).loss.item() == pytest.approx(nll / 10.0, rel=1e-12)
    # the explored episodes' term: the same likelihood by hand, whatever the (meaningless) behaviour log-probs say
    explored = explored_sft_term(LossInputs(T(lp), zeros, T(np.full((n, t), -50.0)), T(np.ones((n, t))), T(mask),
                                            10.0), LossConfig())
    assert explored.loss.item() == pytest.approx(nll / 10.0, rel=1e-12)
    assert explored.metrics["explored_nll"] == pytest.approx(nll / mask.sum(), rel=1e-12)
    assert not explored_sft_term.__dict__.get("needs"), "it needs log-probs alone: no reference, no logits"
    with pytest.raises(ValueError, match="logits"):
        anchor_kl_term(LossInputs(T(lp), zeros, zeros, zeros, T(mask), 10.0), LossConfig())


def test_the_objective_holds_the_terms_the_config_asks_for_and_a_reference_only_when_one_is_needed():
    from learner.config import AnchorConfig, LearnerConfig
    from learner.objective import needs_reference, rl_objective

    default = rl_objective(LearnerConfig())
    assert [(t.name, t.coef, t.samples) for t in default] == [("policy", 1.0, "batch"), ("explored", 1.0, "explored")]
    plain = rl_objective(LearnerConfig(explored_coef=0))
    assert [t.name for t in plain] == ["policy"] and not needs_reference(plain)
    kl = rl_objective(LearnerConfig(loss=LossConfig(kl_beta=0.05), explored_coef=0))
    assert [(t.name, t.coef) for t in kl] == [("policy", 1.0), ("kl", 0.05)] and needs_reference(kl)
    sft_anchor = rl_objective(LearnerConfig(anchor=AnchorConfig(suite="sim:train", kind="sft", coef=0.3),
                                            explored_coef=0))
    assert [(t.name, t.coef, t.samples) for t in sft_anchor] == [("policy", 1.0, "batch"), ("anchor", 0.3, "anchor")]
    assert not needs_reference(sft_anchor)
    assert needs_reference(rl_objective(LearnerConfig(anchor=AnchorConfig(suite="sim:train", kind="kl"))))
    custom = rl_objective(LearnerConfig(loss=LossConfig(name="learner.example_loss:gspo_loss", kl_beta=0.1),
                                        explored_coef=0))
    assert [t.name for t in custom] == ["policy", "kl"], "a custom loss gets the KL term too"


def test_a_bad_loss_or_estimator_name_fails_at_config_load_or_learner_start_before_any_batch():
    from common.config import ConfigError, build
    from learner.config import BUILTIN_LOSSES, LearnerConfig
    from learner.losses import LOSSES
    from learner.trainer import Trainer
    from tests.test_learner import TINY

    assert tuple(LOSSES) == BUILTIN_LOSSES, "the config's list of built-in names is the losses module's"
    for bad in ({"loss": {"name": "gpro"}}, {"advantage": {"name": "gropo"}}, {"loss": {"name": "a b:c"}}):
        with pytest.raises(ConfigError, match="neither built in"):
            build(LearnerConfig, bad)  # every role: a typo is a config error, nothing imported
    cfg = build(LearnerConfig, {"loss": {"name": "no_such_module:fn"}})
    with pytest.raises(ValueError, match="cannot load 'no_such_module:fn'"):
        Trainer(cfg, TINY)  # the learner imports it when it starts, before it asks for any batch
    with pytest.raises(ValueError, match="cannot load 'no_such_module:est'"):
        Trainer(build(LearnerConfig, {"advantage": {"name": "no_such_module:est"}}), TINY)


def test_step_level_advantages_are_refused_where_the_estimator_ignores_turns():
    for name in ("rloo", "batch"):
        with pytest.raises(ValueError, match="'group' estimator only"):
            ADV.AdvantageConfig(name=name, level="step").validate()
    ADV.AdvantageConfig(name="group", level="step").validate()
