"""The objective's terms: pure functions ``(LossInputs, LossConfig) -> LossOutputs``, selected by name or import path.

All tensors are ``[N, T]``: one row per sample (a model turn), one column per predicted token; ``mask`` is 1
on the tokens to train on (the sampled ones) and 0 on padding and prompt. Only those tokens are scored: log-probs
are 0 where the mask is 0, the model's output head never runs there, and logits (for a term that needs them) are
``[M, V]``, one row per loss token. Token-mean aggregation: sums are divided by the number of loss tokens in the
whole step (``num_tokens``), so micro-batches add up.
Metrics are means over the micro-batch's own loss tokens unless the output says otherwise (``reduce``: mean,
max or sum); the trainer weights means by those tokens, which makes them the step's means however it was split.
A metric may be a float or a detached 0-d tensor. The built-in terms give tensors: the trainer reads them all at
the step's end, so a micro-batch never makes the host wait for the GPU (``float(t)`` would, each time).

A term declares what it needs beyond log-probs (``@needs("ref_logprobs")``, ``"ref_logits"``, ``"logits"``);
the trainer computes only that, and builds a reference model only when a term of the objective needs one
(``learner/objective.py`` assembles the terms from the config).

Decoupled GRPO (the policy term), per token t::

    w = exp(logp_prox - logp_behav)              detached; truncated at w_max (mask or clamp, token or sequence)
    u = exp(logp - logp_prox)
    L = -sum_t w * min(u * A, clip(u, 1 - eps_low, 1 + eps_high) * A) / N_tokens

plus, as their own terms, ``kl_beta`` x KL_k3(pi_theta || pi_ref) and the anchor's replay loss on demo turns.

A custom loss is a function with the same signature in any module the learner can import (on its PYTHONPATH):
``loss.name: pkg.mod:fn``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from common.imports import load_by_path
from learner.config import LossConfig

NEEDS = ("ref_logprobs", "ref_logits", "logits")
REDUCTIONS = ("mean", "max", "sum")


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # log pi_theta of each loss token (carries the gradient); 0 where mask is 0 (not scored)
    prox_logprobs: torch.Tensor  # log pi_prox (detached)
    behav_logprobs: torch.Tensor  # log pi_behav, recorded by the actor
    advantages: torch.Tensor  # per token (a sample's advantage broadcast over its tokens)
    mask: torch.Tensor  # float, 1 = loss token
    num_tokens: float  # loss tokens in the whole step (the token-mean denominator)
    ref_logprobs: torch.Tensor | None = None  # log pi_ref of each loss token (when a term needs it)
    # [M, V] pi_theta's next-token logits at the loss tokens (mask > 0, row-major), when a term needs them
    logits: torch.Tensor | None = None
    ref_logits: torch.Tensor | None = None  # [M, V] pi_ref's, at the same tokens (when a term needs them)
    # [M] the mask at the logits' rows (mask[mask > 0], found without a boolean index: that waits for the device)
    logits_mask: torch.Tensor | None = None


@dataclass
class LossOutputs:
    loss: torch.Tensor
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    """floats, or detached 0-d tensors: those stay on the device until the step reads them all at once"""
    reduce: dict[str, str] = field(default_factory=dict)
    """how a metric combines over micro-batches and ranks: mean (token-weighted, the default) | max | sum"""


LossFn = Callable[[LossInputs, LossConfig], LossOutputs]


def needs(*inputs: str) -> Callable[[LossFn], LossFn]:
    """Declare the optional inputs a term reads (``ref_logprobs``, ``ref_logits``, ``logits``)."""
    unknown = [i for i in inputs if i not in NEEDS]
    if unknown:
        raise ValueError(f"unknown loss input {unknown[0]!r}; a term may need: {', '.join(NEEDS)}")

    def mark(fn: LossFn) -> LossFn:
        fn.needs = frozenset(inputs)
        return fn
    return mark


def needs_of(fn: LossFn) -> frozenset[str]:
    return getattr(fn, "needs", frozenset())


def behaviour_weights(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, kept): the detached importance weight per token and the tokens that survive truncation."""
    log_w = (inp.prox_logprobs - inp.behav_logprobs).detach() * inp.mask
    if cfg.w_level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(inp.mask)
    w = torch.exp(log_w.clamp(max=60.0))  # exp of huge log-ratios is inf; truncation handles the rest
    kept = inp.mask.clone()
    if cfg.w_mode == "mask":
        kept = kept * (w <= cfg.w_max)
    elif cfg.w_mode == "clamp":
        w = w.clamp(max=cfg.w_max)
    return w * kept, kept


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi_theta."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over this micro-batch's loss tokens (a metric: detached, 0-d, left on the device)."""
    return (x.detach() * mask).sum() / mask.sum().clamp(min=1)


def _common_metrics(inp: LossInputs, w: torch.Tensor, kept: torch.Tensor) -> dict[str, torch.Tensor]:
    n = inp.mask.sum().clamp(min=1)
    return {"is_weight_mean": (w * inp.mask).sum() / n, "is_weight_max": (w * inp.mask).max(),
            "is_masked_frac": ((inp.mask - kept) > 0).sum() / n}


COMMON_REDUCE = {"is_weight_max": "max"}


def _clipped_surrogate(inp: LossInputs, cfg: LossConfig, eps_low: float, eps_high: float) -> LossOutputs:
    w, kept = behaviour_weights(inp, cfg)
    u = torch.exp(inp.logprobs - inp.prox_logprobs.detach())
    a = inp.advantages
    unclipped, clipped = u * a, u.clamp(1 - eps_low, 1 + eps_high) * a
    per_token = -w * torch.minimum(unclipped, clipped)
    pg = per_token.sum() / inp.num_tokens
    metrics = _common_metrics(inp, w, kept)
    clip_frac = ((clipped < unclipped).float() * inp.mask).sum() / inp.mask.sum().clamp(min=1)
    metrics.update(pg_loss=_token_mean(per_token, inp.mask), clip_frac=clip_frac)
    return LossOutputs(pg, metrics, dict(COMMON_REDUCE))


def grpo_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Decoupled GRPO: clip-higher PPO around pi_prox, behaviour IS weights, optional k3 KL."""
    return _clipped_surrogate(inp, cfg, cfg.eps_low, cfg.eps_high)


def ppo_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """PPO-style: the same decoupling with a symmetric clip (eps_low both ways); advantages from a baseline."""
    return _clipped_surrogate(inp, cfg, cfg.eps_low, cfg.eps_low)


def reinforce_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Off-policy REINFORCE: -w * u * A (no clip); pair it with the RLOO advantage."""
    w, kept = behaviour_weights(inp, cfg)
    u = torch.exp(inp.logprobs - inp.prox_logprobs.detach())
    per_token = -w * u * inp.advantages
    loss = per_token.sum() / inp.num_tokens
    metrics = _common_metrics(inp, w, kept)
    metrics["pg_loss"] = _token_mean(per_token, inp.mask)
    return LossOutputs(loss, metrics, dict(COMMON_REDUCE))


def sft_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Cross-entropy on model tokens (Entropulse SFT phases, behaviour cloning)."""
    nll = -(inp.logprobs * inp.mask).sum() / inp.num_tokens
    return LossOutputs(nll, {"nll": _token_mean(-inp.logprobs, inp.mask)})


@needs("ref_logprobs")
def kl_term(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """The token-mean k3 estimate of KL(pi_theta || pi_ref) on the sampled tokens (weighted by ``kl_beta``)."""
    if inp.ref_logprobs is None:
        raise ValueError("the KL term needs reference log-probs")
    kl_tok = k3_kl(inp.logprobs, inp.ref_logprobs)
    return LossOutputs((kl_tok * inp.mask).sum() / inp.num_tokens, {"kl": _token_mean(kl_tok, inp.mask)})


@needs("logits", "ref_logits")
def anchor_kl_term(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """KL(pi_ref || pi_theta) of each demo position's whole next-token distribution: holds the policy to what the
    reference does there, the probabilities of runner-up tokens included (``learner.anchor.kind: kl``)."""
    if inp.logits is None or inp.ref_logits is None or inp.logits_mask is None:
        raise ValueError("the kl anchor needs the policy's and the reference policy's logits, and their rows' mask")
    ref_logp = torch.log_softmax(inp.ref_logits.float(), dim=-1)
    per_token = (ref_logp.exp() * (ref_logp - torch.log_softmax(inp.logits.float(), dim=-1))).sum(-1)
    weights = inp.logits_mask  # the logits' rows are the loss tokens'
    return LossOutputs((per_token * weights).sum() / inp.num_tokens, {"anchor_loss": _token_mean(per_token, weights)})


def anchor_sft_term(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """The demo tokens' negative log-likelihood (``learner.anchor.kind: sft``): ``sft_loss``, reported as the
    anchor's."""
    out = sft_loss(inp, cfg)
    return LossOutputs(out.loss, {"anchor_loss": out.metrics["nll"]})


def explored_sft_term(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """The negative log-likelihood of the actions in successful explored episodes (workflow exploration: no model
    sampled them, so there is no behaviour log-prob to correct with, only a likelihood to raise): ``sft_loss``,
    reported as ``explored_nll``."""
    out = sft_loss(inp, cfg)
    return LossOutputs(out.loss, {"explored_nll": out.metrics["nll"]})


LOSSES: dict[str, LossFn] = {"grpo": grpo_loss, "ppo": ppo_loss, "reinforce": reinforce_loss, "sft": sft_loss}


def get_loss(name: str) -> LossFn:
    """A built-in loss by name, or a custom one by import path (``pkg.module:function``)."""
    return LOSSES[name] if name in LOSSES else load_by_path(name)
