"""How to add a loss: one function in one file, selected by import path — no change to the trainer.

    learner:
      loss:
        name: learner.example_loss:gspo_loss
        eps_low: 0.0003
        eps_high: 0.0004

This one is GSPO-style: the importance ratio and its clip are taken per sequence (the geometric mean of the
token ratios against pi_prox), so one odd token cannot dominate a long action. It reuses the behaviour
weights of the built-in losses, and reads its knobs from ``LossConfig`` (``extra`` holds any new ones). It is only
the policy term: ``loss.kl_beta`` and the anchor add their own terms whatever the loss (``learner/objective.py``).
Metrics are token means over the micro-batch unless ``reduce`` says max or sum.

The module must be importable by the learner process: inside the repository, installed, or on its PYTHONPATH.
"""

from __future__ import annotations

import torch

from learner.losses import LossConfig, LossInputs, LossOutputs, behaviour_weights


def gspo_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    w, kept = behaviour_weights(inp, cfg)
    lengths = inp.mask.sum(-1).clamp(min=1)
    log_ratio = ((inp.logprobs - inp.prox_logprobs.detach()) * inp.mask).sum(-1) / lengths
    s = torch.exp(log_ratio)[:, None]  # one ratio per sequence, on every token of it
    a = inp.advantages
    per_token = -w * torch.minimum(s * a, s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    loss = per_token.sum() / inp.num_tokens
    tokens = inp.mask.sum().clamp(min=1)
    # metrics as detached 0-d tensors: the trainer reads them once a step, not once a micro-batch
    metrics = {"pg_loss": (per_token.detach() * inp.mask).sum() / tokens,
               "seq_ratio_mean": s.detach().mean(), "seq_ratio_max": s.detach().max()}
    return LossOutputs(loss, metrics, reduce={"seq_ratio_max": "max"})
